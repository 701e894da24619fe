// Checkpoint retention: which of a job's checkpoints go, decided under the coordinator's lock in
// the change that marks them deleted, and their removal once that change is on disk, without the
// lock: local directories on the caller's thread, an object store's on a thread of its own (a
// store that is down, each request retried for seconds, must not stall the coordinator's tick).
#ifndef LOOM_COORDINATOR_RETENTION_H_
#define LOOM_COORDINATOR_RETENTION_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/job_table.h"

namespace loom::coordinator {

class Retention {
 public:
  // `storage_root`: the POSIX root whose jobs/ holds job checkpoints; `checkpoint_store`: the
  // object store ("s3://bucket/prefix") that holds them instead, or "". Nothing outside the
  // jobs/ of whichever holds them is ever deleted.
  Retention(JobTable& table, const std::string& storage_root, const std::string& checkpoint_store);
  ~Retention();  // Stop()

  void Start();  // the object-store remover's thread
  void Stop();   // what is still queued for it is swept with its job's next retention

  // The coordinator's lock held. The job's spec.checkpoint.keep_last newest intact checkpoints
  // and every keep_every-th stay; so does any checkpoint a non-terminal job starts from
  // (init_from). The rest are marked deleted in `txn` (no new job can pin them) and removed once
  // it is committed, with the steps a fenced attempt committed but never reported.
  void Apply(JobTable::Txn& txn, const std::string& job_id);
  // The non-terminal jobs that start from the checkpoint.
  std::vector<std::string> PinnedBy(const std::string& checkpoint_id) const;
  // At open: steps marked deleted whose directories a crash left behind. (On an object store
  // such a step waits for its job's next sweep: a HEAD per deleted checkpoint at every start
  // would grow without bound.)
  void Recover();

  // Without the coordinator's lock: what committed changes decided to remove, once their
  // decisions are on disk (a heartbeat's may still wait for its group commit).
  void CarryOut();

 private:
  // One step, or (on an object store, where listing under the lock would wait on the network)
  // the steps of a job's checkpoint root older than `sweep_before` that neither the catalogue
  // nor keep_every keeps.
  struct Removal {
    std::string dir;
    int64_t sweep_before = -1;
    int64_t keep_every = 0;
    std::set<int64_t> catalogued = {};
  };
  void Remove(JobTable::Txn& txn, Removal removal);  // once `txn` is committed
  void SweepUnreported(JobTable::Txn& txn, const v1::Job& job, int64_t oldest_kept);
  void Delete(const std::vector<Removal>& removals);
  void RemoveRemotely();

  JobTable& table_;
  const std::string jobs_root_;  // "<root>/jobs/": nothing outside it is deleted
  const bool on_store_;          // checkpoints in an object store

  std::mutex mu_;  // pending_ only: filled by commits under the coordinator's lock
  std::vector<Removal> pending_;

  std::mutex remote_mu_;
  std::condition_variable remote_cv_;
  std::vector<Removal> remote_;
  bool remote_stop_ = false;
  std::thread remote_remover_;
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_RETENTION_H_
