#!/usr/bin/env python3
"""`loom` command-line conventions, without a coordinator.

Every command and subcommand listed by `loom --help` (and `loom sweep --help`) answers
`--help` and `-h` with exit 0 and its own usage line; every flag a command's help lists is
accepted by the parser (given after the positional and before it); `--version` names the
version and commit; unknown commands and flags exit 2 (usage) with a message naming them; an
unreachable coordinator exits 6; `submit --set` rejects a bad path or value (exit 2, naming the
field) before contacting the coordinator. The exit codes against a live coordinator (not found,
refused, job failed) are checked in control_plane_test.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile


def loom(args, *argv, env=None):
    return subprocess.run([args.loom, *argv], capture_output=True, text=True, timeout=60, env=env)


def commands(help_text):
    """The names under "Subcommands:" of a CLI11 help text."""
    section = help_text.split("Subcommands:", 1)[1].split("\n\n", 1)[0]
    return [m.group(1) for m in re.finditer(r"^  ([a-z][a-z-]*)\s", section, re.M)]


def flags(help_text):
    """(flag, takes_value) for every option of a help text, except -h/--help."""
    out = []
    section = help_text.split("Options:", 1)[1].split("\n\n", 1)[0]
    for m in re.finditer(r"^  (?:-\w,)?(--[a-z-]+)( [A-Z=.,]+)?\s", section, re.M):
        if m.group(1) not in ("--help", "--version"):
            out.append((m.group(1), bool(m.group(2))))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    args = ap.parse_args()

    top = loom(args, "--help")
    assert top.returncode == 0 and top.stdout.startswith("loom: "), top
    assert "exit codes:" in top.stdout, top.stdout
    names = commands(top.stdout)
    assert {"up", "submit", "list", "status", "logs", "cancel", "plot", "checkpoints", "workers",
            "sweep"} <= set(names), names
    sweep_names = commands(loom(args, "sweep", "--help").stdout)
    assert sweep_names == ["submit", "expand", "list", "status", "cancel", "report", "curves"], sweep_names
    every = [[n] for n in names] + [["sweep", n] for n in sweep_names]
    checked = 0
    for cmd in every:
        for h in ("--help", "-h"):
            r = loom(args, *cmd, h)
            assert r.returncode == 0, (cmd, h, r.stdout, r.stderr)
            assert f"Usage: loom {' '.join(cmd)} " in r.stdout or f"Usage: loom {' '.join(cmd)}\n" in r.stdout, \
                (cmd, r.stdout)
        # Every listed flag parses: with a value where it takes one, in either position. The
        # command then fails for another reason (no coordinator, no such file) but never with
        # a usage error about the flag itself.
        positional = re.search(r"Usage: loom [a-z ]+ \[OPTIONS\] (\w+)", r.stdout)
        for flag, takes_value in flags(r.stdout):
            value = ["1"] if takes_value else []
            pos = ["x"] if positional else []
            for argv in ([*cmd, *pos, flag, *value], [*cmd, flag, *value, *pos]):
                if cmd == ["up"]:
                    continue  # would start services; its flags are covered by parsing --help
                p = loom(args, *argv, "--coordinator", "http://127.0.0.1:1")
                assert "not expected" not in p.stderr and "requires" not in p.stderr.lower(), (argv, p.stderr)
                checked += 1
    version = loom(args, "--version")
    assert version.returncode == 0 and re.match(r"loom \d+\.\d+\.\d+ \(commit \w", version.stdout), version
    for argv, needle in ((["frob"], "unknown command 'frob'"), (["list", "--frob"], "--frob"),
                         (["status"], "job"), (["list", "-o", "xml"], "--output")):
        r = loom(args, *argv, "--coordinator", "http://127.0.0.1:1")
        assert r.returncode == 2 and needle in r.stderr, (argv, r.returncode, r.stderr)
    r = loom(args, "list", "--coordinator", "http://127.0.0.1:1")
    assert r.returncode == 6 and "unreachable" in r.stderr, (r.returncode, r.stderr)
    # submit --set: overrides of the job spec are checked against its schema before anything is
    # sent (a bad path or value exits 2 naming the field); good ones reach the coordinator.
    with tempfile.TemporaryDirectory() as tmp:
        job = os.path.join(tmp, "job.yaml")
        with open(job, "w") as f:
            f.write("preset: micro\nsteps: 10\n")
        for sets, needle in (
                (["optimizer.lrr=1"], "--set optimizer.lrr: JobSpec.optimizer has no field 'lrr'"),
                (["steps=abc"], "--set steps: 'abc' is not an integer"),
                (["model.n_layers=3000000000"], "--set model.n_layers: 3000000000 is out of range"),
                (["optimizer.lr=1e-3", "model.schedule[1].repeat=2"],
                 "--set model.schedule[1].repeat: index 1 past the end"),
                (["steps"], "--set: expected PATH=VALUE")):
            argv = ["submit", job, *[a for s in sets for a in ("--set", s)]]
            r = loom(args, *argv, "--coordinator", "http://127.0.0.1:1")
            assert r.returncode == 2 and needle in r.stderr, (argv, r.returncode, r.stderr)
        r = loom(args, "submit", "--set", "optimizer.lr=3e-4", job, "--set", "model.n_layers=2",
                 "--set", "data.task_options.ops=2-4", "--coordinator", "http://127.0.0.1:1")
        assert r.returncode == 6 and "unreachable" in r.stderr, (r.returncode, r.stderr)
    print(f"ok: --help and -h for {len(every)} commands, {checked} flag placements parsed, "
          f"--version, usage errors exit 2, unreachable exits 6, submit --set checked")


if __name__ == "__main__":
    sys.exit(main())
