#include "base/random_token.h"

#include <gtest/gtest.h>

#include <set>

namespace loom {
namespace {

TEST(RandomHexToken, HexOfTheAskedLengthAndNeverTheSameTwice) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<std::string> token = RandomHexToken();
    ASSERT_TRUE(token.ok()) << token.status();
    ASSERT_EQ(token->size(), 64u);
    EXPECT_EQ(token->find_first_not_of("0123456789abcdef"), std::string::npos) << *token;
    EXPECT_NE(*token, std::string(64, '0'));
    EXPECT_TRUE(seen.insert(*token).second) << *token;
  }
  absl::StatusOr<std::string> short_token = RandomHexToken(4);
  ASSERT_TRUE(short_token.ok());
  EXPECT_EQ(short_token->size(), 8u);
}

TEST(RandomHexToken, RejectsSizesOutOfRange) {
  EXPECT_EQ(RandomHexToken(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RandomHexToken(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RandomHexToken(1025).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace loom
