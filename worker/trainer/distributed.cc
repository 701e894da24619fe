#include "worker/trainer/distributed.h"

#include <cstdlib>

#ifdef LOOM_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only: the deprecated C++ bindings need another library
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "worker/trainer/nccl_comm.h"

namespace loom::trainer {
namespace {

const char* Env(const char* primary, const char* fallback) {
  const char* v = std::getenv(primary);
  if (v == nullptr || *v == '\0') v = std::getenv(fallback);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

}  // namespace

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  bool mpi_initialized_here = false;
#ifdef LOOM_HAVE_NCCL
  std::unique_ptr<NcclComm> nccl;
#endif
};

namespace {

// NCCL on one flat tensor (float32 / float64, host or this rank's device).
absl::Status NcclAllReduceSum(Communicator::Impl& impl, torch::Tensor& flat) {
#ifdef LOOM_HAVE_NCCL
  if (flat.scalar_type() != torch::kFloat32 && flat.scalar_type() != torch::kFloat64) {
    return absl::InvalidArgumentError("nccl all-reduce: only float32 and float64 tensors");
  }
  return impl.nccl->AllReduceSum(flat.data_ptr(), flat.numel(),
                                 flat.scalar_type() == torch::kFloat64, flat.is_cuda());
#else
  return absl::FailedPreconditionError("this build has no NCCL");
#endif
}

}  // namespace

absl::StatusOr<DistributedConfig> DistributedConfigFromEnv(const std::string& backend,
                                                           std::chrono::milliseconds timeout) {
  DistributedConfig c;
  c.timeout = timeout;
  const bool mpi_launcher = Env("OMPI_COMM_WORLD_SIZE", "PMI_SIZE") != nullptr;
  if (backend == "mpi" || (backend == "auto" && mpi_launcher)) {
#ifdef LOOM_HAVE_MPI
    c.backend = "mpi";  // rank and size come from MPI_Init
    return c;
#else
    return absl::FailedPreconditionError(
        "dist_backend: mpi requested, but this build has no MPI (libopenmpi-dev)");
#endif
  }
  if (backend != "auto" && backend != "gloo" && backend != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("dist_backend: '", backend, "' is not auto | gloo | nccl | mpi"));
  }
#ifndef LOOM_HAVE_NCCL
  if (backend == "nccl") {
    return absl::FailedPreconditionError(
        "dist_backend: nccl requested, but this build has no NCCL (CUDA toolkit with nccl.h)");
  }
#endif
  auto read_int = [](const char* primary, const char* fallback, int lo, int hi,
                     int* out) -> absl::Status {
    const char* v = Env(primary, fallback);
    if (v == nullptr) return absl::OkStatus();
    if (!absl::SimpleAtoi(v, out) || *out < lo || *out > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat(primary, ": '", v, "' is not an integer in [", lo, ", ", hi, "]"));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = read_int("LOOM_WORLD_SIZE", "WORLD_SIZE", 1, 65536, &c.world_size); !s.ok())
    return s;
  if (absl::Status s = read_int("LOOM_RANK", "RANK", 0, 65535, &c.rank); !s.ok()) return s;
  if (absl::Status s = read_int("LOOM_MASTER_PORT", "MASTER_PORT", 1, 65535, &c.master_port);
      !s.ok())
    return s;
  if (const char* addr = Env("LOOM_MASTER_ADDR", "MASTER_ADDR")) c.master_addr = addr;
  if (const char* addr = std::getenv("LOOM_NODE_ADDR"); addr != nullptr) c.node_addr = addr;
  if (c.rank >= c.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("LOOM_RANK: ", c.rank, " is not below LOOM_WORLD_SIZE ", c.world_size));
  }
  if (c.world_size > 1 && c.master_port == 0) {
    return absl::InvalidArgumentError("LOOM_MASTER_PORT: required when LOOM_WORLD_SIZE > 1");
  }
  c.backend = c.world_size > 1 ? (backend == "nccl" ? "nccl" : "gloo") : "none";
  return c;
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Create(
    const DistributedConfig& config) {
  std::unique_ptr<Communicator> comm(new Communicator(config));
  comm->impl_ = std::make_unique<Impl>();
  if (config.backend == "mpi") {
#ifdef LOOM_HAVE_MPI
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
        return absl::UnavailableError("dist_backend mpi: MPI_Init failed");
      }
      comm->impl_->mpi_initialized_here = true;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &comm->config_.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &comm->config_.world_size);
    return comm;
#endif
  }
  if (config.world_size == 1) return comm;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(config.master_port);
    store_options.isServer = config.rank == 0;
    store_options.numWorkers = static_cast<size_t>(config.world_size);
    store_options.waitWorkers = true;
    store_options.timeout = config.timeout;
    comm->impl_->store = c10::make_intrusive<c10d::TCPStore>(config.master_addr, store_options);
#ifdef LOOM_HAVE_NCCL
    if (config.backend == "nccl") {
      auto store = comm->impl_->store;
      auto nccl = NcclComm::Create(
          config.rank, config.world_size,
          [store](const std::string& key, const std::string& value) {
            store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
          },
          [store](const std::string& key) {
            std::vector<uint8_t> v = store->get(key);
            return std::string(v.begin(), v.end());
          });
      if (!nccl.ok()) {
        return absl::Status(nccl.status().code(),
                            absl::StrCat("rank ", config.rank, ": ", nccl.status().message()));
      }
      comm->impl_->nccl = *std::move(nccl);
      return comm;
    }
#endif
    auto options = c10d::ProcessGroupGloo::Options::create(config.timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(
        config.node_addr.empty() ? config.master_addr : config.node_addr));
    comm->impl_->group = c10::make_intrusive<c10d::ProcessGroupGloo>(
        comm->impl_->store, config.rank, config.world_size, options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", config.rank, "/", config.world_size,
                                               ": joining the gloo group at ", config.master_addr,
                                               ":", config.master_port, " failed: ", e.what()));
  }
  return comm;
}

absl::StatusOr<std::function<absl::Status()>> Communicator::StartAllReduceSum(torch::Tensor flat) {
  const int r = rank();
  if (world_size() == 1) return std::function<absl::Status()>([] { return absl::OkStatus(); });
  if (config_.backend == "nccl") {
    // NCCL runs on its own CUDA stream; this call waits for it (no overlap on the staged path).
    if (absl::Status s = NcclAllReduceSum(*impl_, flat); !s.ok()) return s;
    return std::function<absl::Status()>([] { return absl::OkStatus(); });
  }
  if (config_.backend == "mpi") {
#ifdef LOOM_HAVE_MPI
    torch::NoGradGuard no_grad;
    torch::Tensor host = flat.to(torch::kCPU).contiguous();
    if (host.scalar_type() != torch::kFloat64 && host.scalar_type() != torch::kFloat32) {
      return absl::InvalidArgumentError("mpi all-reduce: only float32 and float64 tensors");
    }
    const MPI_Datatype type = host.scalar_type() == torch::kFloat64 ? MPI_DOUBLE : MPI_FLOAT;
    if (MPI_Allreduce(MPI_IN_PLACE, host.data_ptr(), static_cast<int>(host.numel()), type, MPI_SUM,
                      MPI_COMM_WORLD) != MPI_SUCCESS) {
      return absl::UnavailableError(absl::StrCat("rank ", r, ": MPI_Allreduce failed"));
    }
    flat.copy_(host);
#endif
    return std::function<absl::Status()>([] { return absl::OkStatus(); });
  }
  try {
    std::vector<torch::Tensor> tensors = {flat};
    auto work = impl_->group->allreduce(tensors);
    return std::function<absl::Status()>([work, r]() mutable {
      try {
        work->wait();
      } catch (const std::exception& e) {
        return absl::UnavailableError(absl::StrCat(
            "rank ", r, ": gradient all-reduce failed (a peer died or timed out): ", e.what()));
      }
      return absl::OkStatus();
    });
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("rank ", r, ": starting an all-reduce failed: ", e.what()));
  }
}

GradientReducer::GradientReducer(Communicator* comm, std::vector<torch::Tensor> params,
                                 int64_t bucket_bytes)
    : comm_(comm), params_(std::move(params)) {
  slot_.assign(params_.size(), {-1, 0});
  has_grad_.assign(params_.size(), false);
  // Reverse order: the last layers' gradients are ready first.
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
    const torch::Tensor& p = params_[i];
    if (!p.requires_grad()) continue;
    if (buckets_.empty() || buckets_.back().flat.scalar_type() != p.scalar_type() ||
        (buckets_.back().flat.numel() + p.numel()) * p.element_size() > bucket_bytes) {
      Bucket b;
      b.flat = torch::zeros({0}, p.options().requires_grad(false));
      buckets_.push_back(std::move(b));
    }
    Bucket& b = buckets_.back();
    slot_[i] = {static_cast<int>(buckets_.size()) - 1, b.flat.numel()};
    b.params.push_back(i);
    b.offsets.push_back(b.flat.numel());
    b.flat = torch::zeros({b.flat.numel() + p.numel()}, b.flat.options());
  }
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    if (slot_[i].first < 0) continue;
    hook_ids_.push_back(params_[i].register_hook([this, i](torch::Tensor g) -> torch::Tensor {
      if (!armed_) return g;
      // The sum of this step's micro-batches: .grad holds the earlier ones. AccumulateGrad then
      // stores what the hook returns into the emptied .grad.
      const torch::Tensor& p = params_[i];
      torch::Tensor full = p.grad().defined() ? p.grad() + g : g;
      p.mutable_grad() = torch::Tensor();
      OnGradient(i, full);
      return full;
    }));
  }
}

GradientReducer::~GradientReducer() {
  for (size_t i = 0, h = 0; i < params_.size(); ++i) {
    if (slot_[i].first >= 0) params_[i].remove_hook(hook_ids_[h++]);
  }
}

void GradientReducer::Arm() {
  armed_ = true;
  in_finish_ = false;
  next_launch_ = 0;
  started_early_ = 0;
  error_ = absl::OkStatus();
  std::fill(has_grad_.begin(), has_grad_.end(), false);
  for (Bucket& b : buckets_) {
    b.ready = 0;
    b.wait = nullptr;
    b.flat.zero_();
  }
}

void GradientReducer::OnGradient(int param, const torch::Tensor& full) {
  torch::NoGradGuard no_grad;
  auto [bi, offset] = slot_[param];
  Bucket& b = buckets_[bi];
  b.flat.narrow(0, offset, full.numel()).copy_(full.reshape({-1}));
  has_grad_[param] = true;
  ++b.ready;
  LaunchReady();
}

void GradientReducer::LaunchReady() {
  while (next_launch_ < buckets_.size() &&
         (in_finish_ ||
          buckets_[next_launch_].ready == static_cast<int>(buckets_[next_launch_].params.size()))) {
    Bucket& b = buckets_[next_launch_++];
    if (!in_finish_) ++started_early_;
    auto wait = comm_->StartAllReduceSum(b.flat);
    if (!wait.ok()) {
      if (error_.ok()) error_ = wait.status();
      b.wait = [] { return absl::OkStatus(); };
    } else {
      b.wait = *std::move(wait);
    }
  }
}

absl::Status GradientReducer::Finish() {
  torch::NoGradGuard no_grad;
  in_finish_ = true;
  LaunchReady();
  armed_ = false;
  absl::Status status = error_;
  for (Bucket& b : buckets_) {
    if (b.wait) {
      absl::Status s = b.wait();
      if (status.ok() && !s.ok()) status = s;
    }
  }
  if (!status.ok()) return status;
  const double world = static_cast<double>(comm_->world_size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!has_grad_[i]) continue;
    auto [bi, offset] = slot_[i];
    torch::Tensor& g = params_[i].mutable_grad();
    g.copy_(buckets_[bi].flat.narrow(0, offset, g.numel()).view_as(g)).div_(world);
  }
  return absl::OkStatus();
}

Communicator::Communicator(DistributedConfig config) : config_(std::move(config)) {}
Communicator::~Communicator() {
#ifdef LOOM_HAVE_MPI
  if (impl_ && impl_->mpi_initialized_here) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
#endif
}

absl::Status Communicator::AllReduceMean(const std::vector<torch::Tensor>& tensors,
                                         int64_t bucket_bytes) {
  if (world_size() == 1) return absl::OkStatus();
  torch::NoGradGuard no_grad;
  size_t i = 0;
  try {
    while (i < tensors.size()) {
      // One bucket: consecutive tensors of one dtype up to bucket_bytes, flattened together.
      std::vector<torch::Tensor> bucket;
      int64_t bytes = 0;
      const auto dtype = tensors[i].scalar_type();
      while (i < tensors.size() && tensors[i].scalar_type() == dtype &&
             (bucket.empty() || bytes + tensors[i].nbytes() <= static_cast<size_t>(bucket_bytes))) {
        bytes += static_cast<int64_t>(tensors[i].nbytes());
        bucket.push_back(tensors[i++]);
      }
      std::vector<torch::Tensor> flat = {torch::cat([&] {
        std::vector<torch::Tensor> views;
        for (const auto& t : bucket) views.push_back(t.reshape({-1}));
        return views;
      }())};
      if (config_.backend == "nccl") {
        if (absl::Status s = NcclAllReduceSum(*impl_, flat[0]); !s.ok()) return s;
      } else if (config_.backend == "mpi") {
#ifdef LOOM_HAVE_MPI
        torch::Tensor host = flat[0].to(torch::kCPU).contiguous();
        const MPI_Datatype type = host.scalar_type() == torch::kFloat64 ? MPI_DOUBLE : MPI_FLOAT;
        if (host.scalar_type() != torch::kFloat64 && host.scalar_type() != torch::kFloat32) {
          return absl::InvalidArgumentError("mpi all-reduce: only float32 and float64 tensors");
        }
        if (MPI_Allreduce(MPI_IN_PLACE, host.data_ptr(), static_cast<int>(host.numel()), type,
                          MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS) {
          return absl::UnavailableError(absl::StrCat("rank ", rank(), ": MPI_Allreduce failed"));
        }
        flat[0].copy_(host);
#endif
      } else {
        impl_->group->allreduce(flat)->wait();
      }
      flat[0].div_(world_size());
      int64_t offset = 0;
      for (auto& t : bucket) {
        t.copy_(flat[0].narrow(0, offset, t.numel()).view_as(t));
        offset += t.numel();
      }
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", rank(),
                                               ": gradient all-reduce failed (a peer rank died or ",
                                               "hung past the timeout): ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status Communicator::Broadcast(const std::vector<torch::Tensor>& tensors, int root) {
  if (world_size() == 1 || tensors.empty()) return absl::OkStatus();
  torch::NoGradGuard no_grad;
  try {
    size_t i = 0;
    while (i < tensors.size()) {
      std::vector<torch::Tensor> run;
      const auto dtype = tensors[i].scalar_type();
      while (i < tensors.size() && tensors[i].scalar_type() == dtype) run.push_back(tensors[i++]);
      std::vector<torch::Tensor> views;
      for (const auto& t : run) views.push_back(t.reshape({-1}));
      std::vector<torch::Tensor> flat = {torch::cat(views).contiguous()};
      if (config_.backend == "nccl") {
#ifdef LOOM_HAVE_NCCL
        if (absl::Status s =
                impl_->nccl->Broadcast(flat[0].data_ptr(), static_cast<int64_t>(flat[0].nbytes()),
                                       root, flat[0].is_cuda());
            !s.ok()) {
          return s;
        }
#endif
      } else if (config_.backend == "mpi") {
#ifdef LOOM_HAVE_MPI
        const MPI_Datatype type = dtype == torch::kFloat64 ? MPI_DOUBLE : MPI_FLOAT;
        if (MPI_Bcast(flat[0].data_ptr(), static_cast<int>(flat[0].numel()), type, root,
                      MPI_COMM_WORLD) != MPI_SUCCESS) {
          return absl::UnavailableError(absl::StrCat("rank ", rank(), ": MPI_Bcast failed"));
        }
#endif
      } else {
        c10d::BroadcastOptions options;
        options.rootRank = root;
        impl_->group->broadcast(flat, options)->wait();
      }
      int64_t offset = 0;
      for (auto& t : run) {
        t.copy_(flat[0].narrow(0, offset, t.numel()).view_as(t));
        offset += t.numel();
      }
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", rank(),
                                               ": parameter broadcast failed (a peer rank died or ",
                                               "hung past the timeout): ", e.what()));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Communicator::AllReduceMean(double value) {
  torch::Tensor t = torch::tensor({value}, torch::kFloat64);
  if (absl::Status s = AllReduceMean({t}); !s.ok()) return s;
  return t.item<double>();
}

absl::Status Communicator::Barrier() {
  if (world_size() == 1) return absl::OkStatus();
  try {
#ifdef LOOM_HAVE_MPI
    if (config_.backend == "mpi") {
      MPI_Barrier(MPI_COMM_WORLD);
      return absl::OkStatus();
    }
#endif
    if (config_.backend == "nccl") {
      torch::Tensor one = torch::ones({1}, torch::kFloat32);
      return NcclAllReduceSum(*impl_, one);
    }
    impl_->group->barrier()->wait();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", rank(), ": barrier failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace loom::trainer
