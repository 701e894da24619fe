// Debian's libcpp-httplib is split: <httplib.h> declares, libcpp-httplib.so implements, and the
// library was built with CPPHTTPLIB_{OPENSSL,ZLIB,BROTLI}_SUPPORT. Those defines change the layout
// of httplib::Client/ClientImpl, so a translation unit compiled without them disagrees with the
// library about every object it hands over (undefined behaviour in every request). This test is
// compiled the way users of loom_rest_client are, and checks that its defines match what the
// library exports.
#include <gtest/gtest.h>
#include <httplib.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

// Path of libcpp-httplib.so, from pkg-config at configure time (client/CMakeLists.txt).
std::string LibraryPath() {
  const char* p = std::getenv("LOOM_CPP_HTTPLIB_LIBRARY");
  return p ? p : "";
}

// `nm -D --defined-only <lib>`: the library's exported (mangled) symbols, one per line.
std::string ExportedSymbols(const std::string& lib, int* status) {
  const char* nm = std::getenv("LOOM_NM");
  const std::string cmd = std::string(nm && *nm ? nm : "nm") + " -D --defined-only '" + lib + "'";
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) {
    *status = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  *status = pclose(f);
  return out;
}

struct Feature {
  const char* define;
  bool defined;        // in this translation unit
  const char* symbol;  // a substring of a symbol the library exports only with the feature
};

constexpr Feature kFeatures[] = {
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
    {"CPPHTTPLIB_OPENSSL_SUPPORT", true, "SSLClient"},
#else
    {"CPPHTTPLIB_OPENSSL_SUPPORT", false, "SSLClient"},
#endif
#ifdef CPPHTTPLIB_ZLIB_SUPPORT
    {"CPPHTTPLIB_ZLIB_SUPPORT", true, "gzip_compressor"},
#else
    {"CPPHTTPLIB_ZLIB_SUPPORT", false, "gzip_compressor"},
#endif
#ifdef CPPHTTPLIB_BROTLI_SUPPORT
    {"CPPHTTPLIB_BROTLI_SUPPORT", true, "brotli_compressor"},
#else
    {"CPPHTTPLIB_BROTLI_SUPPORT", false, "brotli_compressor"},
#endif
};

TEST(HttplibAbi, CompileDefinesMatchTheSharedLibrary) {
  const std::string lib = LibraryPath();
  ASSERT_FALSE(lib.empty()) << "LOOM_CPP_HTTPLIB_LIBRARY is not set (ctest sets it from "
                               "pkg-config; run the test through ctest)";
  int status = 0;
  const std::string syms = ExportedSymbols(lib, &status);
  ASSERT_EQ(status, 0) << "nm -D --defined-only " << lib << " failed:\n" << syms.substr(0, 500);
  ASSERT_NE(syms.find("ClientImpl"), std::string::npos)
      << lib << " exports no httplib::ClientImpl symbols; is it cpp-httplib?";
  for (const Feature& f : kFeatures) {
    const bool exported = syms.find(f.symbol) != std::string::npos;
    EXPECT_EQ(f.defined, exported)
        << f.define << " is " << (f.defined ? "" : "NOT ") << "defined in this translation unit, "
        << "but " << lib << (exported ? " exports " : " does not export ") << f.symbol
        << " symbols: httplib::Client's layout differs between our code and the library. "
        << "Everything that includes <httplib.h> must be compiled with `pkg-config --cflags "
           "cpp-httplib` (link PkgConfig::LOOM_CPP_HTTPLIB or loom_rest_client PUBLIC).";
  }
}

// Builds a client, configures it and runs a request through the library: with a mismatched
// layout the setters and Get write into the wrong members (crash, or a wrong error).
TEST(HttplibAbi, ClientRequestFailsCleanly) {
  httplib::Client client("http://127.0.0.1:1");
  client.set_connection_timeout(1, 0);
  client.set_read_timeout(1, 0);
  client.set_write_timeout(1, 0);
  client.set_bearer_token_auth("loom-test-token");
  client.set_keep_alive(false);
  httplib::Result res = client.Get("/v1/health");
  EXPECT_FALSE(res);
  EXPECT_EQ(res.error(), httplib::Error::Connection) << "got " << httplib::to_string(res.error());
  EXPECT_TRUE(client.is_valid());
}

}  // namespace
