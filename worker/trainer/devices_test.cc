// The trainer's choice of GPU from LOCAL_RANK and the visible devices (no GPU needed: the choice
// is a function of the launcher's environment and the device count).
#include "worker/trainer/devices.h"

#include <gtest/gtest.h>

namespace loom::trainer {
namespace {

TEST(CudaDeviceForRank, TheOnlyVisibleDeviceWhenTheLauncherBoundOne) {
  // The worker agent sets CUDA_VISIBLE_DEVICES to this rank's GPU: whatever its LOCAL_RANK, the
  // rank sees one device, 0.
  for (const char* local : {"0", "3", "7"}) EXPECT_EQ(*CudaDeviceForRank(local, 1), 0) << local;
  EXPECT_EQ(*CudaDeviceForRank(nullptr, 1), 0);
}

TEST(CudaDeviceForRank, LocalRankAmongSeveralVisibleDevices) {
  // torchrun / Slurm: every rank of a node sees all its GPUs and takes GPU LOCAL_RANK.
  for (int i = 0; i < 8; ++i) EXPECT_EQ(*CudaDeviceForRank(std::to_string(i).c_str(), 8), i);
  EXPECT_EQ(*CudaDeviceForRank(nullptr, 4), 0);
}

TEST(CudaDeviceForRank, NeverASharedOrMissingGpu) {
  auto beyond = CudaDeviceForRank("2", 2);
  ASSERT_FALSE(beyond.ok());
  EXPECT_NE(beyond.status().message().find("LOCAL_RANK 2 but only 2"), std::string::npos)
      << beyond.status();
  EXPECT_EQ(CudaDeviceForRank("0", 0).status().code(), absl::StatusCode::kFailedPrecondition);
  for (const char* bad : {"-1", "x", "", "1.5"}) {
    EXPECT_EQ(CudaDeviceForRank(bad, 4).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace loom::trainer
