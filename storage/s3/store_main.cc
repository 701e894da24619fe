// loom-store: the object store as Loom's programs see it (the same client, options and retries),
// for operators and tests: copy files up and down, list, delete, and upload a local checkpoint
// with the commit protocol (shards first, manifest last).
//
//   loom-store put FILE s3://bucket/key        loom-store get s3://bucket/key FILE
//   loom-store ls s3://bucket/prefix            loom-store rm s3://bucket/key
//   loom-store upload-checkpoint STEP_DIR s3://bucket/root
//   loom-store checkpoints s3://bucket/root
#include <cstdio>
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "storage/checkpoint_store.h"
#include "storage/s3/s3_client.h"

namespace {

using loom::storage::S3Client;
using loom::storage::S3Location;

constexpr char kUsage[] =
    "usage: loom-store put FILE s3://bucket/key | get s3://bucket/key FILE | ls s3://bucket/prefix"
    " | rm s3://bucket/key | upload-checkpoint STEP_DIR s3://bucket/root"
    " | checkpoints s3://bucket/root\n";

absl::Status Run(int argc, char** argv) {
  if (argc < 3) return absl::InvalidArgumentError(kUsage);
  const std::string cmd = argv[1];
  LOOM_ASSIGN_OR_RETURN(loom::storage::S3Options options,
                        loom::storage::S3OptionsFromEnvironment());
  S3Client client(options);
  auto url = [&](int i) -> absl::StatusOr<S3Location> {
    if (i >= argc) return absl::InvalidArgumentError(kUsage);
    return loom::storage::ParseS3Url(argv[i]);
  };
  if (cmd == "put" && argc == 4) {
    LOOM_ASSIGN_OR_RETURN(S3Location to, url(3));
    return client.PutFile(to.bucket, to.prefix, argv[2]);
  }
  if (cmd == "get" && argc == 4) {
    LOOM_ASSIGN_OR_RETURN(S3Location from, url(2));
    return client.GetFile(from.bucket, from.prefix, argv[3]);
  }
  if (cmd == "ls" && argc == 3) {
    LOOM_ASSIGN_OR_RETURN(S3Location at, url(2));
    LOOM_ASSIGN_OR_RETURN(auto objects, client.List(at.bucket, at.prefix));
    for (const auto& o : objects) std::cout << o.size << "\t" << o.key << "\n";
    return absl::OkStatus();
  }
  if (cmd == "rm" && argc == 3) {
    LOOM_ASSIGN_OR_RETURN(S3Location at, url(2));
    return client.Delete(at.bucket, at.prefix);
  }
  if (cmd == "upload-checkpoint" && argc == 4) {
    LOOM_ASSIGN_OR_RETURN(auto store, loom::storage::OpenCheckpointStore(argv[3]));
    LOOM_ASSIGN_OR_RETURN(std::string where, store->Upload(argv[2]));
    std::cout << where << "\n";
    return absl::OkStatus();
  }
  if (cmd == "checkpoints" && argc == 3) {
    LOOM_ASSIGN_OR_RETURN(auto store, loom::storage::OpenCheckpointStore(argv[2]));
    LOOM_ASSIGN_OR_RETURN(auto refs, store->List());
    for (const auto& r : refs) std::cout << r.step << "\t" << r.dir << "\n";
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(kUsage);
}

}  // namespace

int main(int argc, char** argv) {
  absl::Status s = Run(argc, argv);
  if (!s.ok()) {
    std::fprintf(stderr, "loom-store: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
