// The loader against real plugin libraries: the shipped mha/local plugins and six deliberately
// broken ones (testdata/). Each failure must have its own clear error, and the process (and the
// loader) must keep working afterwards.
#include "worker/trainer/plugin_loader.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "worker/trainer/plugin_factory.h"

namespace loom::trainer {
namespace {

std::string TestPluginDir() {
  const char* d = std::getenv("LOOM_TEST_PLUGIN_DIR");
  return d ? d : "";
}
std::string PluginDir() {
  const char* d = std::getenv("LOOM_PLUGIN_PATH");
  return d ? d : "";
}
std::string Broken(const std::string& kind) {
  return TestPluginDir() + "/libbroken_" + kind + ".so";
}

void ExpectError(const absl::Status& s, absl::StatusCode code,
                 std::initializer_list<std::string> parts) {
  EXPECT_EQ(s.code(), code) << s;
  for (const std::string& p : parts)
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s;
}

TEST(PluginLoader, LoadsShippedPlugins) {
  PluginLoader loader;
  LoadReport report = loader.LoadDirectories({PluginDir()});
  EXPECT_TRUE(report.failures.empty());
  ASSERT_TRUE(loader.Find("mha", LOOM_PLUGIN_KIND_ATTENTION).ok());
  ASSERT_TRUE(loader.Find("local", LOOM_PLUGIN_KIND_ATTENTION).ok());
  EXPECT_STREQ((*loader.Find("mha", LOOM_PLUGIN_KIND_ATTENTION))->plugin->build_stamp,
               PluginLoader::ExpectedBuildStamp());
}

TEST(PluginLoader, WrongAbiVersion) {
  PluginLoader loader;
  ExpectError(loader.LoadFile(Broken("abi_version")), absl::StatusCode::kFailedPrecondition,
              {"libbroken_abi_version.so", "ABI version mismatch",
               "plugin has " + std::to_string(LOOM_PLUGIN_ABI_VERSION + 998),
               "loader expects " + std::to_string(LOOM_PLUGIN_ABI_VERSION)});
}

TEST(PluginLoader, MissingEntrySymbol) {
  PluginLoader loader;
  ExpectError(loader.LoadFile(Broken("no_entry")), absl::StatusCode::kFailedPrecondition,
              {"libbroken_no_entry.so", "missing entry symbol 'loom_plugin_v1'"});
}

TEST(PluginLoader, BuildStampMismatch) {
  PluginLoader loader;
  ExpectError(loader.LoadFile(Broken("bad_stamp")), absl::StatusCode::kFailedPrecondition,
              {"libbroken_bad_stamp.so", "build stamp mismatch", "torch=0.1",
               PluginLoader::ExpectedBuildStamp()});
}

TEST(PluginLoader, UnresolvedSymbolFailsAtLoad) {
  PluginLoader loader;
  ExpectError(
      loader.LoadFile(Broken("undefined_symbol")), absl::StatusCode::kFailedPrecondition,
      {"libbroken_undefined_symbol.so", "dlopen failed", "loom_symbol_that_does_not_exist"});
}

TEST(PluginLoader, MissingFile) {
  PluginLoader loader;
  ExpectError(loader.LoadFile(TestPluginDir() + "/libnothing.so"), absl::StatusCode::kNotFound,
              {"libnothing.so", "no such file"});
}

TEST(PluginLoader, DuplicateName) {
  PluginLoader loader;
  ASSERT_TRUE(loader.LoadFile(PluginDir() + "/libloom_attention_mha.so").ok());
  ExpectError(loader.LoadFile(Broken("duplicate_name")), absl::StatusCode::kAlreadyExists,
              {"libbroken_duplicate_name.so", "duplicate name 'mha'", "libloom_attention_mha.so"});
  // The first mha is still the one in use.
  EXPECT_NE(
      (*loader.Find("mha", LOOM_PLUGIN_KIND_ATTENTION))->path.find("libloom_attention_mha.so"),
      std::string::npos);
}

TEST(PluginLoader, FactoryThatFails) {
  PluginLoader loader;
  ASSERT_TRUE(loader.LoadFile(Broken("factory_fails")).ok());
  v1::AttentionConfig config;
  config.set_plugin("factory_fails");
  AttentionShape shape{16, 4, 4, true, false, 0, 0, 1};
  auto layer = CreateAttentionLayer(loader, config, shape);
  ExpectError(layer.status(), absl::StatusCode::kInternal,
              {"layer 0 (factory_fails)", "refusing to build a layer"});
}

TEST(PluginLoader, OneBadLibraryDoesNotStopTheOthers) {
  PluginLoader loader;
  LoadReport report = loader.LoadDirectories({PluginDir(), TestPluginDir(), "/nonexistent/dir"});
  // Five broken libraries fail (factory_fails loads: its failure comes at create time).
  EXPECT_EQ(report.failures.size(), 5u);
  EXPECT_TRUE(loader.Find("mha", LOOM_PLUGIN_KIND_ATTENTION).ok());
  EXPECT_TRUE(loader.Find("local", LOOM_PLUGIN_KIND_ATTENTION).ok());
  EXPECT_TRUE(loader.Find("factory_fails", LOOM_PLUGIN_KIND_ATTENTION).ok());
  // And the working plugins still build layers after all those failures.
  v1::AttentionConfig config;
  config.set_plugin("mha");
  AttentionShape shape{16, 4, 4, true, false, 10000, 0, 1};
  auto layer = CreateAttentionLayer(loader, config, shape);
  ASSERT_TRUE(layer.ok()) << layer.status();
  torch::Tensor y = (*layer)->forward(torch::randn({1, 3, 16}), {torch::arange(3), {}});
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{1, 3, 16}));
}

TEST(PluginLoader, BadOptionsAreInvalidArgumentNamingTheField) {
  PluginLoader loader;
  loader.LoadDirectories({PluginDir()});
  v1::AttentionConfig config;
  config.set_plugin("local");
  AttentionShape shape{16, 4, 4, true, false, 0, 2, 3};
  ExpectError(CreateAttentionLayer(loader, config, shape).status(),
              absl::StatusCode::kInvalidArgument, {"layer 2 (local)", "window"});
  config.set_window(4);
  (*config.mutable_options()->mutable_fields())["colour"].set_string_value("red");
  ExpectError(CreateAttentionLayer(loader, config, shape).status(),
              absl::StatusCode::kInvalidArgument, {"options.colour", "unknown option"});
  config.set_plugin("nope");
  ExpectError(CreateAttentionLayer(loader, config, shape).status(), absl::StatusCode::kNotFound,
              {"no attention plugin named 'nope'", "local", "mha"});
}

}  // namespace
}  // namespace loom::trainer
