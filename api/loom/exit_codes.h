// Exit codes of loom-train that the control plane acts on (docs/control-plane.md, "Attempts,
// failures and restarts"): the trainer sets them, the worker agent and the coordinator read them.
#ifndef LOOM_EXIT_CODES_H_
#define LOOM_EXIT_CODES_H_

namespace loom {

// The spec, its data or its paths are wrong (InvalidArgument / NotFound): never retried.
inline constexpr int kExitBadInput = 2;
// The rank's lease ran out (its agent lost the coordinator): an infrastructure failure.
inline constexpr int kExitLeaseExpired = 75;
// The rank was asked to stop (SIGTERM: preemption, walltime, a drained node) and stopped after
// writing a checkpoint: an infrastructure event, the job resumes from that checkpoint.
inline constexpr int kExitStopped = 76;

}  // namespace loom

#endif  // LOOM_EXIT_CODES_H_
