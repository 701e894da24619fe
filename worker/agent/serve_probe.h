// The health of a kind: serve job's loom-serve, as its agent sees it: GET /healthz every period
// on a thread of its own, so a server that hangs (or is SIGSTOPped) costs that thread a
// timeout, never the agent's main loop its heartbeats. The agent reads the results (atomics)
// and decides what to do (agent_serve.cc).
#ifndef LOOM_WORKER_AGENT_SERVE_PROBE_H_
#define LOOM_WORKER_AGENT_SERVE_PROBE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace loom::agent {

class ServeProbe {
 public:
  struct Options {
    int period_ms = 1000;   // between the end of one probe and the start of the next
    int timeout_ms = 1000;  // connect, and then the answer
  };
  // Starts probing `url` (http://host:port) + "/healthz" at once.
  ServeProbe(std::string url, Options options);
  // Stop(), then waits for the thread: at most the probe in flight (its timeouts).
  ~ServeProbe();
  ServeProbe(const ServeProbe&) = delete;
  ServeProbe& operator=(const ServeProbe&) = delete;

  // Asks the thread to end after the probe in flight, if any; returns at once.
  void Stop();
  // Whether the last probe was answered 200.
  bool ready() const { return ready_.load(); }
  // LeaseClockMs() when a probe was last answered 200; 0 until one is.
  int64_t last_ok_ms() const { return last_ok_ms_.load(); }

 private:
  void Loop();

  const std::string url_;
  const Options options_;
  std::atomic<bool> ready_{false};
  std::atomic<int64_t> last_ok_ms_{0};
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace loom::agent

#endif  // LOOM_WORKER_AGENT_SERVE_PROBE_H_
