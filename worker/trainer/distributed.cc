#include "distributed.h"

#include <cstdlib>
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
};

absl::StatusOr<DistributedConfig> DistributedConfigFromEnv(std::chrono::milliseconds timeout) {
  DistributedConfig c;
  c.timeout = timeout;
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
  return c;
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Create(
    const DistributedConfig& config) {
  std::unique_ptr<Communicator> comm(new Communicator(config));
  comm->impl_ = std::make_unique<Impl>();
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
Communicator::~Communicator() = default;

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
      impl_->group->allreduce(flat)->wait();
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

absl::StatusOr<double> Communicator::AllReduceMean(double value) {
  torch::Tensor t = torch::tensor({value}, torch::kFloat64);
  if (absl::Status s = AllReduceMean({t}); !s.ok()) return s;
  return t.item<double>();
}

absl::Status Communicator::Barrier() {
  if (world_size() == 1) return absl::OkStatus();
  try {
    impl_->group->barrier()->wait();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", rank(), ": barrier failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace loom::trainer
