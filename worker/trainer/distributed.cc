#include "distributed.h"

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
};

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
  if (backend != "auto" && backend != "gloo") {
    return absl::InvalidArgumentError(
        absl::StrCat("dist_backend: '", backend, "' is not auto | gloo | mpi"));
  }
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
  if (c.rank >= c.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("LOOM_RANK: ", c.rank, " is not below LOOM_WORLD_SIZE ", c.world_size));
  }
  if (c.world_size > 1 && c.master_port == 0) {
    return absl::InvalidArgumentError("LOOM_MASTER_PORT: required when LOOM_WORLD_SIZE > 1");
  }
  c.backend = c.world_size > 1 ? "gloo" : "none";
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
    auto options = c10d::ProcessGroupGloo::Options::create(config.timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(config.master_addr));
    comm->impl_->group = c10::make_intrusive<c10d::ProcessGroupGloo>(
        comm->impl_->store, config.rank, config.world_size, options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", config.rank, "/", config.world_size,
                                               ": joining the gloo group at ", config.master_addr,
                                               ":", config.master_port, " failed: ", e.what()));
  }
  return comm;
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
      if (config_.backend == "mpi") {
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
      if (config_.backend == "mpi") {
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
    impl_->group->barrier()->wait();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", rank(), ": barrier failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace loom::trainer
