#!/usr/bin/env python3
"""TLS end to end, with a certificate made by the openssl CLI at test time.

A private CA signs the coordinator's certificate (SAN IP 127.0.0.1). The coordinator serves both
ports over TLS (the user API's HTTP and the agents' gRPC); a worker agent registers and
heartbeats over https with --ca-file; the CLI
submits a job over https and follows it to success (so registration, heartbeats, placement and
the job's reports all crossed TLS). Python's ssl module, trusting only that CA, reads the API;
a plain-HTTP request to the TLS port gets no HTTP answer; the CLI without the CA refuses the
server (exit 6, "not trusted"); a key that does not match the certificate stops the coordinator
with an error naming --tls-key. Mutual TLS on the agent port (--client-ca): an agent with a
client certificate of that CA registers and heartbeats; a client certificate of another CA, or
none, is refused at the handshake (UNAVAILABLE, nothing reaches the service); a plaintext client
gets no service either. Every process is stopped on exit.
"""
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loom_testlib import AgentClient, control_plane_arg_parser, kill_all, read_port_file, wait_for  # noqa: E402

PROCS = []
TOKEN = "tls-user-token-0123456789abcdef"
ENROL = "tls-enrolment-token-0123456789ab"


def openssl(*argv, cwd):
    subprocess.run(["openssl", *argv], cwd=cwd, check=True, capture_output=True, timeout=120)


def make_certificates(tmp):
    """ca.pem signs server.pem (SAN 127.0.0.1 and localhost); other.pem is an unrelated CA."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=loom test CA", cwd=tmp)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=loom coordinator", cwd=tmp)
    with open(os.path.join(tmp, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "san.ext", cwd=tmp)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.pem",
            "-days", "2", "-subj", "/CN=another CA", cwd=tmp)
    # Client certificates for mutual TLS: node.pem from the test CA, rogue.pem from the other one.
    for name, ca in (("node", "ca"), ("rogue", "other")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=tmp)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", cwd=tmp)


def start(argv, log, env=None):
    p = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    PROCS.append(p)
    return p


def check_mutual_tls(args, path):
    """A second coordinator that requires client certificates of the test CA on its agent port."""
    common = [args.coordinator, "--data-dir", path("state-mtls"), "--user-tokens", path("users"),
              "--worker-token-file", path("enrolment"), "--port", "0", "--agent-port", "0",
              "--port-file", path("port-mtls"), "--agent-port-file", path("agent-port-mtls"),
              "--heartbeat-ms", "200", "--tls-cert", path("server.pem"), "--tls-key", path("server.key")]
    no_tls = subprocess.run(common[:-4] + ["--client-ca", path("ca.pem")], capture_output=True, text=True,
                            timeout=60)
    assert no_tls.returncode != 0 and "--client-ca" in no_tls.stderr, (no_tls.returncode, no_tls.stderr)
    start(common + ["--client-ca", path("ca.pem")], path("coordinator-mtls.log"))
    port = wait_for("the user port", lambda: read_port_file(path("port-mtls")), 30)
    agent_port = wait_for("the agent port", lambda: read_port_file(path("agent-port-mtls")), 30)
    enrol = {"address": "127.0.0.1", "slots": 1, "name": "probe"}
    for what, cert in (("a client certificate of another CA", "rogue"), ("no client certificate", None)):
        client = AgentClient(args.agent_stubs, agent_port, ca_file=path("ca.pem"),
                             client_cert=cert and path(f"{cert}.pem"), client_key=cert and path(f"{cert}.key"))
        code, _, message = client.register(enrol, ENROL)
        client.close()
        assert code == "UNAVAILABLE", f"{what}: {code} {message}"
    plain = AgentClient(args.agent_stubs, agent_port)
    code, _, message = plain.register(enrol, ENROL)
    plain.close()
    assert code == "UNAVAILABLE", f"plaintext on the mutual-TLS port: {code} {message}"
    # The agent with its node certificate.
    start([args.worker, "--coordinator", f"https://127.0.0.1:{agent_port}", "--ca-file", path("ca.pem"),
           "--client-cert", path("node.pem"), "--client-key", path("node.key"),
           "--token-file", path("enrolment"), "--work-dir", path("worker-mtls"), "--slots", "1",
           "--loom-train", args.loom_train], path("worker-mtls.log"))
    env = {**os.environ, "LOOM_COORDINATOR": f"https://127.0.0.1:{port}", "LOOM_TOKEN": TOKEN,
           "LOOM_CA_FILE": path("ca.pem")}
    workers = lambda: json.loads(subprocess.run(  # noqa: E731
        [args.loom, "workers", "-o", "json"], env=env, capture_output=True, text=True, timeout=60).stdout or "{}")
    listed = wait_for("the worker over mutual TLS", lambda: [w for w in workers().get("workers", [])
                                                              if w["state"] == "alive"], 30)
    assert len(listed) == 1 and listed[0]["name"] != "probe", listed
    print("ok: mutual TLS on the agent port: the agent with a certificate of the client CA registered and "
          "heartbeats; another CA's certificate, none, and plaintext refused at the handshake; "
          "--client-ca without TLS refused at start")


def main():
    args = control_plane_arg_parser().parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-tls-")
    try:
        make_certificates(tmp)
        path = lambda *p: os.path.join(tmp, *p)  # noqa: E731
        with open(path("users"), "w") as f:
            f.write(f"alice {TOKEN}\n")
        with open(path("enrolment"), "w") as f:
            f.write(ENROL + "\n")
        with open(path("user-token"), "w") as f:
            f.write(TOKEN + "\n")
        common = [args.coordinator, "--data-dir", path("state"), "--user-tokens", path("users"),
                  "--worker-token-file", path("enrolment"), "--port", "0", "--agent-port", "0",
                  "--port-file", path("port"), "--agent-port-file", path("agent-port"),
                  "--heartbeat-ms", "200"]
        # A key that is not the certificate's: refused at start, naming the flag.
        bad = subprocess.run(common + ["--tls-cert", path("server.pem"), "--tls-key", path("other.key")],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "--tls-key" in bad.stderr, (bad.returncode, bad.stderr)

        start(common + ["--tls-cert", path("server.pem"), "--tls-key", path("server.key")], path("coordinator.log"))
        port = wait_for("the user port", lambda: read_port_file(path("port")), 30)
        agent_port = wait_for("the agent port", lambda: read_port_file(path("agent-port")), 30)
        url = f"https://127.0.0.1:{port}"

        # Python's own TLS stack, trusting only the test CA.
        ctx = ssl.create_default_context(cafile=path("ca.pem"))
        req = urllib.request.Request(url + "/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            assert r.status == 200 and json.load(r)["jobs"] == []
        strict = ssl.create_default_context(cafile=path("other.pem"))
        try:
            urllib.request.urlopen(req, context=strict, timeout=10)
            raise AssertionError("a certificate from another CA was accepted")
        except urllib.error.URLError as e:
            assert isinstance(e.reason, ssl.SSLCertVerificationError), e
        # Plain HTTP on the TLS port: no HTTP answer, and the listener keeps serving.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            s.settimeout(15)
            try:
                data = s.recv(4096)
            except (ConnectionResetError, socket.timeout):
                data = b""
            assert not data.startswith(b"HTTP/"), data[:100]

        env = {**os.environ, "LOOM_COORDINATOR": url, "LOOM_TOKEN": TOKEN}
        env.pop("LOOM_CA_FILE", None)
        untrusted = subprocess.run([args.loom, "list"], env=env, capture_output=True, text=True, timeout=60)
        assert untrusted.returncode == 6 and "not trusted" in untrusted.stderr, (untrusted.returncode, untrusted.stderr)

        start([args.worker, "--coordinator", f"https://127.0.0.1:{agent_port}", "--ca-file", path("ca.pem"),
               "--token-file", path("enrolment"), "--work-dir", path("worker"), "--slots", "1",
               "--loom-train", args.loom_train], path("worker.log"))
        env["LOOM_CA_FILE"] = path("ca.pem")
        wait_for("the worker over https", lambda: "alive" in subprocess.run(
            [args.loom, "workers"], env=env, capture_output=True, text=True, timeout=60).stdout, 30)
        job = {"preset": "micro", "steps": 20, "micro_batch": 4, "seq_len": 32, "threads": 1,
               "data": {"corpus_bytes": 65536}, "eval": {"batches": 1}}
        with open(path("job.json"), "w") as f:
            json.dump(job, f)
        run = subprocess.run([args.loom, "submit", path("job.json"), "--follow"], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "succeeded" in run.stdout, (run.returncode, run.stdout[-2000:], run.stderr)
        print("ok: TLS on both ports (cert from a test CA made by openssl): a job submitted, run and "
              "followed over https; Python ssl trusts only that CA; plain HTTP and an untrusted client "
              "refused; a mismatched key refused at start")
        check_mutual_tls(args, path)
    finally:
        kill_all(PROCS)
        for name in ("coordinator.log", "worker.log", "coordinator-mtls.log", "worker-mtls.log"):
            p = os.path.join(tmp, name)
            if os.path.exists(p):
                with open(p) as f:
                    sys.stdout.write(f"--- {name} (tail) ---\n" + "".join(f.readlines()[-15:]))


if __name__ == "__main__":
    main()
