// The trainer's side of the control plane's fencing (docs/control-plane.md, "Fencing"). A rank
// launched by a worker agent gets LOOM_LEASE_FILE: a file the agent rewrites after every
// heartbeat that reached the coordinator, holding the steady-clock time (CLOCK_MONOTONIC, in
// milliseconds) until which the rank may run. When it passes, the coordinator is about to
// declare the worker lost and run the job elsewhere, so the rank stops at once (exit 75) and
// never commits a checkpoint after that time. Standalone runs have no lease.
#ifndef LOOM_WORKER_TRAINER_LEASE_H_
#define LOOM_WORKER_TRAINER_LEASE_H_

namespace loom::trainer {

// Starts a thread that ends the process (exit 75) once the lease expires; no-op without
// LOOM_LEASE_FILE. Call once, early.
void StartLeaseWatchdog();

// Ends the process (exit 75) when the lease has expired; call right before a durable write
// (checkpoint commit) so no write lands after the coordinator may have moved on.
void RequireLease(const char* before_what);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_LEASE_H_
