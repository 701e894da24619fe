// The trainer in-process: the loss falls, gradient accumulation equals a larger batch, the NaN
// guard skips and then fails, the schedule is right. Multi-process behaviour (exact resume,
// kill -9 during a checkpoint, /metrics) is in tests/trainer_e2e_test.py.
#include "worker/trainer/trainer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "data/tokenizer.h"
#include "loom/spec.h"
#include "storage/checkpoint.h"
#include "worker/trainer/corpus.h"
#include "worker/trainer/tensor_io.h"

namespace loom::trainer {
namespace {

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::set_num_threads(1);
    ASSERT_TRUE(loader_.LoadDirectories({std::getenv("LOOM_PLUGIN_PATH")}).failures.empty());
  }
  v1::JobSpec Spec(const std::string& json) {
    v1::JobSpec spec;
    EXPECT_TRUE(ParseJsonMessage(json, "test", &spec).ok());
    auto resolved = ResolveJobSpec(spec);
    EXPECT_TRUE(resolved.ok()) << resolved.status();
    return *resolved;
  }
  PluginLoader loader_;
};

TEST_F(TrainerTest, LossFallsByMargin) {
  auto t = Trainer::Create(Spec(R"({"preset": "micro", "data": {"corpus_bytes": 262144}})"),
                           loader_, {});
  ASSERT_TRUE(t.ok()) << t.status();
  auto summary = (*t)->Run();
  ASSERT_TRUE(summary.ok()) << summary.status();
  // Untrained, a byte model sits near ln(256) = 5.55 nats. 150 steps must take the held-out
  // loss below 2.6 nats, at least 2.5 lower than where it started.
  EXPECT_GT(summary->first_eval_loss, 5.0);
  EXPECT_LT(summary->last_eval_loss, 2.6);
  EXPECT_LT(summary->last_eval_loss, summary->first_eval_loss - 2.5);
  EXPECT_EQ(summary->steps.size(), 150u);
  EXPECT_EQ((*t)->step(), 150);
}

TEST_F(TrainerTest, GradientAccumulationEqualsTheLargerBatch) {
  const char* base =
      R"({"preset": "micro", "steps": 4, "precision": "fp64", "optimizer": {"warmup_steps": 1},
                         "data": {"corpus_bytes": 65536}, "eval": {"batches": 1}, )";
  auto a = Trainer::Create(Spec(std::string(base) + R"("micro_batch": 8, "grad_accum": 1})"),
                           loader_, {});
  auto b = Trainer::Create(Spec(std::string(base) + R"("micro_batch": 4, "grad_accum": 2})"),
                           loader_, {});
  ASSERT_TRUE(a.ok() && b.ok());
  auto ra = (*a)->Run(), rb = (*b)->Run();
  ASSERT_TRUE(ra.ok() && rb.ok());
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(ra->steps[i].loss, rb->steps[i].loss, 1e-12) << i;
  auto pa = (*a)->model().named_parameters(), pb = (*b)->model().named_parameters();
  for (const auto& p : pa) {
    EXPECT_LT((p.value() - pb[p.key()]).abs().max().item<double>(), 1e-10) << p.key();
  }
}

// The fused flash kernels (the CPU default of mha, local and iha) train exactly like the dense
// reference kernels they replaced: 50 steps of a two-layer model (global + windowed, RoPE) give
// the same losses within float32 tolerance. The two only sum in different orders, so the
// difference stays at rounding size (measured: 1e-7); 1e-4 relative bounds its growth over 50
// AdamW steps (a wrong mask, scale or gradient moves the loss by far more within a few steps).
TEST_F(TrainerTest, FusedKernelsTrainLikeTheReferenceKernels) {
  for (const char* plugin : {"mha", "iha"}) {
    auto spec = [&](const std::string& kernel) {
      const std::string global = absl::StrCat(R"({"plugin": ")", plugin,
                                              R"(", "options": {"kernel": ")", kernel, R"("}})");
      const std::string local =
          absl::StrCat(R"({"plugin": ")", std::string(plugin) == "mha" ? "local" : "iha",
                       R"(", "window": 16, "options": {"kernel": ")", kernel, R"("}})");
      return Spec(absl::StrCat(
          R"({"preset": "micro", "steps": 50, "micro_batch": 4, "seq_len": 64,
              "optimizer": {"warmup_steps": 5}, "data": {"corpus_bytes": 65536},
              "eval": {"batches": 1}, "model": {"n_layers": 2, "max_seq_len": 64, "schedule": [
              {"repeat": 1, "attention": )",
          local, R"(}, {"repeat": 1, "attention": )", global, "}]}}"));
    };
    auto fused = Trainer::Create(spec("fused"), loader_, {});
    auto reference = Trainer::Create(spec("reference"), loader_, {});
    ASSERT_TRUE(fused.ok()) << fused.status();
    ASSERT_TRUE(reference.ok()) << reference.status();
    auto a = (*fused)->Run(), b = (*reference)->Run();
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->steps.size(), 50u);
    ASSERT_EQ(b->steps.size(), 50u);
    for (size_t i = 0; i < a->steps.size(); ++i) {
      EXPECT_NEAR(a->steps[i].loss, b->steps[i].loss, 1e-4 * b->steps[i].loss)
          << plugin << " step " << i + 1;
    }
    EXPECT_LT(a->steps.back().loss, a->steps.front().loss - 0.5) << plugin << " learns";
  }
}

// The row-split linear (cpu_kernels/linear_cpu.h), which every projection, FFN and LM head takes
// on more than one thread, trains like torch::linear (LOOM_CPU_LINEAR=torch, read at each call):
// 50 steps of a two-layer mha + iha model at two threads give the same losses within float32
// tolerance (the same bound as the fused kernels' test above, for the same reason: the two only
// split the GEMMs' rows differently).
TEST_F(TrainerTest, RowSplitLinearTrainsLikeTorchLinear) {
  const v1::JobSpec spec = Spec(R"({"preset": "micro", "steps": 50, "micro_batch": 8,
      "seq_len": 64, "threads": 2, "optimizer": {"warmup_steps": 5},
      "data": {"corpus_bytes": 65536}, "eval": {"batches": 1}, "model": {"n_layers": 2,
      "max_seq_len": 64, "schedule": [{"repeat": 1, "attention": {"plugin": "iha"}},
                                       {"repeat": 1, "attention": {"plugin": "mha"}}]}})");
  auto run = [&](const char* linear) {
    setenv("LOOM_CPU_LINEAR", linear, 1);
    auto trainer = Trainer::Create(spec, loader_, {});
    EXPECT_TRUE(trainer.ok()) << trainer.status();
    absl::StatusOr<TrainSummary> summary = (*trainer)->Run();
    unsetenv("LOOM_CPU_LINEAR");
    return summary;
  };
  auto split = run("split");
  auto reference = run("torch");
  ASSERT_TRUE(split.ok() && reference.ok());
  ASSERT_EQ(split->steps.size(), 50u);
  ASSERT_EQ(reference->steps.size(), 50u);
  for (size_t i = 0; i < 50; ++i) {
    EXPECT_NEAR(split->steps[i].loss, reference->steps[i].loss, 1e-4 * reference->steps[i].loss)
        << "step " << i + 1;
  }
  EXPECT_LT(split->steps.back().loss, split->steps.front().loss - 0.5) << "learns";
}

// bf16 mixed precision on the CPU (autocast): tiny-cpu's local + mha schedule, narrowed to
// d_model 64 and 2 layers, tracks its fp32 run from the same seed at every step over 200 steps
// (kBf16Tolerance nats), the parameters stay fp32 (master weights), the checkpoint holds fp32
// weights and AdamW moments, and a resume from step 150 ends bitwise where the uninterrupted
// bf16 run ends. Small because on CPUs without AVX-512 LibTorch's bf16 matmuls take a scalar
// path (~16x fp32's time: the full tiny-cpu model made this test 230 s of a loaded 2-core CI
// run), micro-batches of 4 rows, and lr 1e-3, because at that batch the preset's 3e-3 gives loss
// spikes that land on different steps in the two runs (measured at the full width: 0.40 nats
// apart at one step with 3e-3, at most 0.085 with 1e-3; at this width at most 0.032).
constexpr double kBf16Tolerance = 0.15;

TEST_F(TrainerTest, Bf16TracksFp32KeepsFp32MasterWeightsAndResumesBitwise) {
  const std::string dir = ::testing::TempDir() + "/loom-bf16-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  auto spec = [&](const std::string& precision, const std::string& ckpt) {
    return Spec(absl::StrCat(R"({"preset": "tiny-cpu", "steps": 200, "micro_batch": 4,
                                 "model": {"d_model": 64, "n_layers": 2},
                                 "optimizer": {"lr": 0.001}, "precision": ")",
                             precision,
                             R"(", "data": {"corpus_bytes": 262144}, "eval": {"batches": 1},
                                 "checkpoint": {"dir": ")",
                             ckpt, R"(", "interval": 50}})"));
  };
  auto fp32 = Trainer::Create(spec("fp32", dir + "/fp32"), loader_, {});
  auto bf16 = Trainer::Create(spec("bf16", dir + "/bf16"), loader_, {});
  ASSERT_TRUE(fp32.ok() && bf16.ok());
  auto r32 = (*fp32)->Run();
  auto r16 = (*bf16)->Run();
  ASSERT_TRUE(r32.ok() && r16.ok()) << r32.status() << r16.status();
  ASSERT_EQ(r16->steps.size(), 200u);
  double worst = 0;
  for (size_t i = 0; i < r16->steps.size(); ++i)
    worst = std::max(worst, std::abs(r16->steps[i].loss - r32->steps[i].loss));
  EXPECT_LT(worst, kBf16Tolerance);
  EXPECT_NE(r16->steps.back().loss, r32->steps.back().loss) << "bf16 must really run in bf16";
  std::cout << "bf16 vs fp32: largest per-step loss difference " << worst << " nats; final "
            << r16->steps.back().loss << " vs " << r32->steps.back().loss << "\n";
  for (const auto& p : (*bf16)->model().parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  auto loaded = storage::LoadCheckpoint(dir + "/bf16/step-00000200");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto tensors = TensorsFromFile(loaded->shards[0]);
  ASSERT_TRUE(tensors.ok());
  int64_t floating = 0;
  for (const auto& [name, t] : *tensors) {
    if (!t.is_floating_point()) continue;  // e.g. byte-encoded sampler state
    EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
    ++floating;
  }
  EXPECT_GT(floating, 30) << "weights and both AdamW moments";

  TrainerOptions resume;
  resume.resume = dir + "/bf16/step-00000150";
  auto second = Trainer::Create(spec("bf16", dir + "/bf16-resumed"), loader_, resume);
  ASSERT_TRUE(second.ok()) << second.status();
  auto r2 = (*second)->Run();
  ASSERT_TRUE(r2.ok()) << r2.status();
  ASSERT_EQ(r2->steps.size(), 50u);
  for (size_t i = 0; i < 50; ++i) EXPECT_EQ(r2->steps[i].loss, r16->steps[150 + i].loss) << i;
  const auto a = ModuleTensors((*bf16)->model()), b = ModuleTensors((*second)->model());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
  std::filesystem::remove_all(dir);
}

// Dynamic loss scaling (what fp16 on CUDA uses) on the CPU in fp32: scaling by powers of two is
// exact, so without overflow the run is bitwise the unscaled one, while the scale grows every
// growth_interval clean steps.
TEST_F(TrainerTest, DynamicLossScalingWithoutOverflowIsExact) {
  auto spec = [&](const std::string& scaling) {
    return Spec(absl::StrCat(R"({"preset": "micro", "steps": 30, "data": {"corpus_bytes": 65536},
                                 "eval": {"batches": 1}, "loss_scale": )",
                             scaling, "}"));
  };
  auto plain = Trainer::Create(spec(R"({"mode": "none"})"), loader_, {});
  auto scaled = Trainer::Create(
      spec(R"({"mode": "dynamic", "initial": 65536, "growth_interval": 10})"), loader_, {});
  ASSERT_TRUE(plain.ok() && scaled.ok());
  auto a = (*plain)->Run();
  auto b = (*scaled)->Run();
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  ASSERT_EQ(b->steps.size(), 30u);
  for (size_t i = 0; i < 30; ++i) {
    EXPECT_EQ(a->steps[i].loss, b->steps[i].loss) << i;
    EXPECT_EQ(a->steps[i].grad_norm, b->steps[i].grad_norm) << i;
    EXPECT_EQ(b->steps[i].loss_scale, 65536.0 * (1 << (i / 10))) << i;  // grows after 10 steps
    EXPECT_EQ(a->steps[i].loss_scale, 0.0);
  }
  EXPECT_EQ(b->loss_scale_overflows, 0);
}

// Real overflow: with an initial scale of 2^127 (fp32's largest power of two) and steps of two
// tokens (one sequence of 2: per-token gradients are large) the scaled gradients exceed fp32's
// range (measured: gradient norms of 5-10 at scale 1, overflowing at 2^127 within the first
// steps), so that step is skipped and the scale halved until the backward fits. Overflows are not
// divergences (max_nan_skips 1 would stop the run at the first if they counted), and a resume from
// a checkpoint restores the scale: it ends bitwise where the uninterrupted run ends.
TEST_F(TrainerTest, LossScalingSkipsOverflowsAndResumesExactly) {
  const std::string dir = ::testing::TempDir() + "/loom-scale-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  auto spec = [&](const std::string& ckpt) {
    return Spec(absl::StrCat(R"({"preset": "micro", "steps": 40, "max_nan_skips": 1,
                                 "micro_batch": 1, "seq_len": 2,
                                 "data": {"corpus_bytes": 65536}, "eval": {"batches": 1},
                                 "loss_scale": {"mode": "dynamic", "initial": 1.7014118346046923e38,
                                                "growth_interval": 1000},
                                 "checkpoint": {"dir": ")",
                             ckpt, R"(", "interval": 20}})"));
  };
  auto first = Trainer::Create(spec(dir + "/a"), loader_, {});
  ASSERT_TRUE(first.ok()) << first.status();
  auto r = (*first)->Run();
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->steps.size(), 40u);
  size_t first_overflow = 0;
  while (first_overflow < 20 && !r->steps[first_overflow].overflowed) ++first_overflow;
  ASSERT_LT(first_overflow, 20u) << "no overflow at 2^127 in the first 20 steps";
  EXPECT_EQ(r->steps[first_overflow].loss_scale, 0x1p127);
  EXPECT_EQ(r->steps[first_overflow + 1].loss_scale, 0x1p126);
  EXPECT_GE(r->loss_scale_overflows, 1);
  EXPECT_EQ(r->nan_skipped, 0);
  int64_t overflows = 0;
  for (const StepRecord& s : r->steps) {
    EXPECT_TRUE(std::isfinite(s.loss));
    EXPECT_EQ(s.skipped, s.overflowed);
    overflows += s.overflowed;
  }
  EXPECT_EQ(overflows, r->loss_scale_overflows);
  EXPECT_FALSE(r->steps.back().overflowed) << "the scale settles where the backward fits";
  double early = 0, late = 0;  // two tokens a step: compare means of ten steps
  for (size_t i = 0; i < 10; ++i) early += r->steps[i].loss, late += r->steps[30 + i].loss;
  EXPECT_LT(late, early) << "and training goes on";
  const std::string text = (*first)->registry().Render();
  EXPECT_NE(
      text.find(absl::StrCat(
          "loom_train_loss_scale_overflows_total{job_id=\"standalone\",rank=\"0\"} ", overflows)),
      std::string::npos)
      << text;
  std::cout << "loss scaling from 2^127: " << overflows << " overflow(s), scale settled at "
            << r->steps.back().loss_scale << "\n";

  TrainerOptions resume;
  resume.resume = dir + "/a/step-00000020";
  auto second = Trainer::Create(spec(dir + "/b"), loader_, resume);
  ASSERT_TRUE(second.ok()) << second.status();
  auto r2 = (*second)->Run();
  ASSERT_TRUE(r2.ok()) << r2.status();
  ASSERT_EQ(r2->steps.size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(r2->steps[i].loss, r->steps[20 + i].loss) << i;
    EXPECT_EQ(r2->steps[i].loss_scale, r->steps[20 + i].loss_scale) << i;
  }
  std::filesystem::remove_all(dir);
}

TEST_F(TrainerTest, NanGuardSkipsThenFails) {
  TrainerOptions nan_at_3_4;
  nan_at_3_4.test.nan_at_steps = {3, 4};
  auto t = Trainer::Create(
      Spec(
          R"({"preset": "micro", "steps": 6, "data": {"corpus_bytes": 65536}, "eval": {"batches": 1}})"),
      loader_, nan_at_3_4);
  ASSERT_TRUE(t.ok());
  auto summary = (*t)->Run();
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->nan_skipped, 2);
  EXPECT_TRUE(summary->steps[2].skipped);
  EXPECT_TRUE(summary->steps[3].skipped);
  EXPECT_FALSE(summary->steps[4].skipped);
  const std::string text = (*t)->registry().Render();
  EXPECT_NE(text.find("loom_train_nan_skipped_steps_total{job_id=\"standalone\",rank=\"0\"} 2"),
            std::string::npos);

  TrainerOptions nan_at_2_3_4;
  nan_at_2_3_4.test.nan_at_steps = {2, 3, 4};
  auto failing = Trainer::Create(
      Spec(
          R"({"preset": "micro", "steps": 6, "max_nan_skips": 3, "data": {"corpus_bytes": 65536}, "eval": {"batches": 1}})"),
      loader_, nan_at_2_3_4);
  ASSERT_TRUE(failing.ok());
  auto failed = (*failing)->Run();
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("step 4: 3 consecutive non-finite steps"),
            std::string::npos)
      << failed.status();
}

// Every built-in task trains: its held-out loss falls within a short run.
TEST_F(TrainerTest, LossFallsOnEveryBuiltInTask) {
  struct Case {
    const char* task;
    const char* model;
    const char* extra;
    double margin;
  };
  const char* decoder = R"("model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256,
                                      "max_seq_len": 256, "rope_theta": 10000, "tie_embeddings": true})";
  const char* encoder =
      R"("model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 2, "max_seq_len": 100,
                                      "mode": "encoder", "num_classes": 1, "grid_max_rows": 10, "grid_max_cols": 10,
                                      "tie_embeddings": false})";
  const Case cases[] = {
      {"relation_binary", encoder, R"("seq_len": 100)", 0.02},
      {"relation_ternary", encoder, R"("seq_len": 100)", 0.02},
      {"needle", decoder,
       R"("seq_len": 256, "data": {"source": "task", "task": "needle", "task_options": {"needles": 2}})",
       1.0},
      {"khop", decoder, R"("seq_len": 128)", 1.0},
      {"poly_filter", decoder, R"("seq_len": 128)", 1.0},
      {"arithmetic", decoder, R"("seq_len": 256)", 1.0},
  };
  for (const Case& c : cases) {
    std::string json =
        std::string(
            R"({"preset": "micro", "steps": 60, "micro_batch": 16, "eval": {"batches": 4}, )") +
        c.model + ", " + c.extra;
    if (std::string(c.extra).find("\"data\"") == std::string::npos) {
      json += std::string(R"(, "data": {"source": "task", "task": ")") + c.task + "\"}";
    }
    json += "}";
    auto t = Trainer::Create(Spec(json), loader_, {});
    ASSERT_TRUE(t.ok()) << c.task << ": " << t.status();
    auto summary = (*t)->Run();
    ASSERT_TRUE(summary.ok()) << c.task << ": " << summary.status();
    EXPECT_LT(summary->last_eval_loss, summary->first_eval_loss - c.margin)
        << c.task << ": " << summary->first_eval_loss << " -> " << summary->last_eval_loss;
    EXPECT_GT(summary->last_eval_accuracy, 0.0) << c.task;
    std::cout << c.task << ": eval loss " << summary->first_eval_loss << " -> "
              << summary->last_eval_loss << ", accuracy " << summary->last_eval_accuracy
              << ", exact match " << summary->last_eval_exact_match << "\n";
  }
}

// The App. D protocol: fixed splits, epochs, validation every epoch, patience, the test metric
// at the best validation epoch; and an exact resume in the middle of an epoch.
class SplitsTest : public TrainerTest {
 protected:
  std::string Json(const std::string& dir, const std::string& jsonl) {
    return R"({"preset": "micro", "steps": 400, "micro_batch": 32, "seq_len": 100,
      "optimizer": {"lr": 0.03, "min_lr": 0.03, "warmup_steps": 1},
      "model": {"d_model": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 2, "max_seq_len": 100,
                "mode": "encoder", "num_classes": 1, "grid_max_rows": 10, "grid_max_cols": 10,
                "tie_embeddings": false, "rope_theta": 0},
      "data": {"source": "task", "task": "relation_binary",
               "splits": {"train": 256, "validation": 64, "test": 64}},
      "eval": {"patience": 2},
      "checkpoint": {"dir": ")" +
           dir + R"(", "interval": 4, "keep_last": 100},
      "metrics": {"jsonl": ")" +
           jsonl + R"("}})";
  }
  struct Eval {
    std::string split;
    int64_t step = 0, epoch = 0;
    double loss = 0;
  };
  static std::vector<Eval> Evals(const std::string& jsonl) {
    std::vector<Eval> out;
    std::ifstream in(jsonl);
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"event\":\"eval\"") == std::string::npos) continue;
      Eval e;
      auto field = [&](const std::string& key) {
        const size_t at = line.find("\"" + key + "\":");
        return at == std::string::npos
                   ? std::string()
                   : line.substr(at + key.size() + 3,
                                 line.find_first_of(",}", at) - at - key.size() - 3);
      };
      e.split = field("split");
      e.step = std::stoll(field("step"));
      e.epoch = field("epoch").empty() ? 0 : std::stoll(field("epoch"));
      e.loss = std::stod(field("eval_loss"));
      out.push_back(e);
    }
    return out;
  }
};

TEST_F(SplitsTest, StopsAfterPatienceAndReportsTestAtBestEpoch) {
  const std::string root = ::testing::TempDir() + "/loom-splits-a";
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  auto t = Trainer::Create(Spec(Json(root + "/ckpt", root + "/m.jsonl")), loader_, {});
  ASSERT_TRUE(t.ok()) << t.status();
  auto s = (*t)->Run();
  ASSERT_TRUE(s.ok()) << s.status();
  // 256 examples / 32 per step: 8 steps per epoch, 50 epochs at most.
  ASSERT_TRUE(s->early_stopped) << "ran " << s->epochs << " epochs";
  EXPECT_LT(s->final_step, 400);
  EXPECT_EQ(s->final_step, s->epochs * 8);
  // Recompute the protocol from the JSONL: one validation per epoch end, a test after each new
  // best, a stop `patience` epochs after the best.
  std::vector<Eval> evals = Evals(root + "/m.jsonl");
  double best = std::numeric_limits<double>::infinity();
  int64_t best_epoch = 0, bad = 0, last_test_epoch = -1, validations = 0;
  for (size_t i = 0; i < evals.size(); ++i) {
    const Eval& e = evals[i];
    ASSERT_TRUE(e.split == "\"validation\"" || e.split == "\"test\"") << e.split;
    if (e.split == "\"test\"") {
      last_test_epoch = e.epoch;
      continue;
    }
    if (e.step == 0) continue;  // the step-0 evaluation is not an epoch end
    ++validations;
    EXPECT_EQ(e.step, e.epoch * 8);
    const bool improved = e.loss < best;
    if (improved) {
      best = e.loss;
      best_epoch = e.epoch;
      bad = 0;
    } else {
      ++bad;
    }
    const bool next_is_test = i + 1 < evals.size() && evals[i + 1].split == "\"test\"";
    EXPECT_EQ(next_is_test, improved) << "epoch " << e.epoch;
  }
  EXPECT_EQ(validations, s->epochs);
  EXPECT_EQ(bad, 2);
  EXPECT_EQ(s->best_epoch, best_epoch);
  EXPECT_EQ(s->epochs, best_epoch + 2);
  EXPECT_EQ(last_test_epoch, best_epoch);
  EXPECT_EQ(s->best_validation_loss, best);
  EXPECT_GE(s->test_accuracy, 0.0);
  std::cout << "splits: " << s->epochs << " epochs, best " << best_epoch << " (validation " << best
            << "), test loss " << s->test_loss << " accuracy " << s->test_accuracy
            << " exact match " << s->test_exact_match << "\n";

  // Stop in the middle of epoch 2 (step 12), resume: the same losses, stop and test metric.
  const std::string root2 = ::testing::TempDir() + "/loom-splits-b";
  std::filesystem::remove_all(root2);
  std::filesystem::create_directories(root2);
  TrainerOptions first;
  first.stop_after = 12;
  auto b = Trainer::Create(Spec(Json(root2 + "/ckpt", root2 + "/m1.jsonl")), loader_, first);
  ASSERT_TRUE(b.ok()) << b.status();
  auto sb = (*b)->Run();
  ASSERT_TRUE(sb.ok()) << sb.status();
  ASSERT_EQ(sb->final_step, 12);
  TrainerOptions second;
  second.resume = root2 + "/ckpt";
  auto c = Trainer::Create(Spec(Json(root2 + "/ckpt", root2 + "/m2.jsonl")), loader_, second);
  ASSERT_TRUE(c.ok()) << c.status();
  auto sc = (*c)->Run();
  ASSERT_TRUE(sc.ok()) << sc.status();
  ASSERT_EQ(sb->steps.size() + sc->steps.size(), s->steps.size());
  for (size_t i = 0; i < s->steps.size(); ++i) {
    const StepRecord& r = i < 12 ? sb->steps[i] : sc->steps[i - 12];
    EXPECT_EQ(r.loss, s->steps[i].loss) << "step " << i + 1;
    // Training FLOPs are cumulative across the resume: step k has k times step 1's.
    EXPECT_EQ(r.train_flops, s->steps[i].train_flops) << "step " << i + 1;
    EXPECT_NEAR(r.train_flops, static_cast<double>(i + 1) * s->steps[0].train_flops,
                1e-9 * r.train_flops)
        << "step " << i + 1;
  }
  EXPECT_GT(s->steps[0].train_flops, 0);
  EXPECT_EQ(sc->final_step, s->final_step);
  EXPECT_EQ(sc->best_epoch, s->best_epoch);
  EXPECT_EQ(sc->test_loss, s->test_loss);
  EXPECT_EQ(sc->test_accuracy, s->test_accuracy);
  EXPECT_EQ(sc->test_exact_match, s->test_exact_match);
}

// Relations of different sizes share a batch of a split: the padding is masked, so an example's
// logits do not depend on what it is batched with.
TEST_F(SplitsTest, PaddedRelationsScoreAsAlone) {
  const std::string root = ::testing::TempDir() + "/loom-splits-pad";
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  auto t = Trainer::Create(Spec(Json(root + "/ckpt", root + "/m.jsonl")), loader_, {});
  ASSERT_TRUE(t.ok()) << t.status();
  auto made = data::MakeTask("relation_binary", {}, 100);
  ASSERT_TRUE(made.ok());
  auto split = MakeTaskSplit(**made, 40, 3);
  const data::Example *small = nullptr, *big = nullptr;
  for (const auto& e : split->examples) {
    if (small == nullptr || e.tokens.size() < small->tokens.size()) small = &e;
    if (big == nullptr || e.tokens.size() > big->tokens.size()) big = &e;
  }
  ASSERT_LT(small->tokens.size(), big->tokens.size());
  auto logits = [&](const TrainBatch& b) {
    torch::NoGradGuard no_grad;
    ModelInputs in;
    in.tokens = b.inputs;
    in.grid_rows = b.rows;
    in.grid_cols = b.cols;
    in.positions = b.positions;
    in.segments = b.segments;
    (*t)->model().eval();
    return (*t)->model().forward(in);
  };
  const TrainBatch alone = TaskBatch({small}, true), mixed = TaskBatch({small, big}, true);
  ASSERT_TRUE(mixed.segments.defined());
  ASSERT_FALSE(alone.segments.defined());  // nothing to mask
  const int64_t m = static_cast<int64_t>(small->tokens.size());
  const torch::Tensor a = logits(alone)[0], b = logits(mixed)[0].narrow(0, 0, m);
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-5);
  // Unmasked, the padding would change the result.
  TrainBatch unmasked = TaskBatch({small, big}, false);
  EXPECT_GT((a - logits(unmasked)[0].narrow(0, 0, m)).abs().max().item<double>(), 1e-4);
}

TEST_F(TrainerTest, TaskModelMismatchesNameTheField) {
  auto mismatch = [&](const std::string& json, const std::string& field) {
    auto t = Trainer::Create(Spec(json), loader_, {});
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find(field), std::string::npos) << t.status();
  };
  mismatch(R"({"preset": "micro", "data": {"source": "task", "task": "relation_binary"}})",
           "model.mode");
  mismatch(
      R"({"preset": "micro", "seq_len": 100, "model": {"mode": "encoder", "num_classes": 3, "tie_embeddings": false,
               "grid_max_rows": 10, "grid_max_cols": 10}, "data": {"source": "task", "task": "relation_binary"}})",
      "model.num_classes");
  mismatch(
      R"({"preset": "micro", "data": {"source": "task", "task": "khop", "task_options": {"hops": 99}}})",
      "data.task_options.hops");
}

TEST_F(TrainerTest, CudaRequestWithoutCudaIsAClearError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  auto t = Trainer::Create(Spec(R"({"preset": "micro", "device": "cuda"})"), loader_, {});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("device: cuda requested"), std::string::npos) << t.status();
}

// SFT on the built-in reasoning conversations (kind sft, data.source chat): packed rows with
// only assistant tokens scored, and the held-out loss falls.
TEST_F(TrainerTest, SftOnBuiltInReasoningLearns) {
  auto t = Trainer::Create(Spec(R"({"preset": "micro", "kind": "sft", "model": {"vocab_size": 260},
      "data": {"source": "chat", "task": "arithmetic", "task_options": {"count": "400"}},
      "seq_len": 128, "steps": 60, "micro_batch": 8, "eval": {"batches": 4}})"),
                           loader_, {});
  ASSERT_TRUE(t.ok()) << t.status();
  auto summary = (*t)->Run();
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_LT(summary->last_eval_loss, summary->first_eval_loss - 2.0)
      << summary->first_eval_loss << " -> " << summary->last_eval_loss;
}

TEST(ChatSampler, ScoresOnlyAssistantTokensAndRestartsPositions) {
  data::ChatTemplate chat;
  data::Conversation a{{{data::Role::kUser, "q1"}, {data::Role::kAssistant, "a1"}}};
  data::Conversation b{{{data::Role::kUser, "q22"}, {data::Role::kAssistant, "b"}}};
  auto rows = std::make_shared<const std::vector<data::PackedRow>>(data::Pack(
      {data::EncodeChat(a, chat, data::EncodeBytes), data::EncodeChat(b, chat, data::EncodeBytes)},
      17, 0));
  ASSERT_EQ(rows->size(), 1u);
  ChatSampler sampler(rows, 1);
  TrainBatch batch = sampler.Next(2);
  ASSERT_EQ(batch.inputs.sizes(), (std::vector<int64_t>{2, 16}));
  // a: <user> q 1 <end> <assistant> a 1 <end>  (8 tokens, the last 3 scored)
  // b: <user> q 2 2 <end> <assistant> b <end>  (8 tokens, the last 2 scored); 1 padding token.
  const std::vector<int64_t> targets = {-1, -1, -1, -1, 'a', '1', chat.end(), -1,
                                        -1, -1, -1, -1, -1,  'b', chat.end(), -1};
  const std::vector<int64_t> positions = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int64_t> segments = {1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2};
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_EQ(std::vector<int64_t>(batch.targets[r].data_ptr<int64_t>(),
                                   batch.targets[r].data_ptr<int64_t>() + 16),
              targets);
    EXPECT_EQ(std::vector<int64_t>(batch.positions[r].data_ptr<int64_t>(),
                                   batch.positions[r].data_ptr<int64_t>() + 16),
              positions);
    EXPECT_EQ(std::vector<int64_t>(batch.segments[r].data_ptr<int64_t>(),
                                   batch.segments[r].data_ptr<int64_t>() + 16),
              segments);
  }
}

TEST(ChatSampler, PromptPositionsCannotChangeTheLoss) {
  // The SFT loss is the mean cross-entropy over assistant targets only: whatever the logits (or
  // the would-be labels) at prompt, marker and padding positions, the loss is the same and its
  // gradient there is exactly zero. Checked against a float64 computation by hand.
  data::ChatTemplate chat;
  data::Conversation a{{{data::Role::kUser, "what?"}, {data::Role::kAssistant, "this"}}};
  auto rows = std::make_shared<const std::vector<data::PackedRow>>(
      data::Pack({data::EncodeChat(a, chat, data::EncodeBytes)}, 14, 0));
  ChatSampler sampler(rows, 3);
  TrainBatch batch = sampler.Next(1);
  torch::manual_seed(2);
  torch::Tensor logits = torch::randn({1, 13, 260}, torch::kFloat64).requires_grad_();
  torch::Tensor loss = ScoreBatch(logits, batch, false).loss;
  loss.backward();
  torch::Tensor scored = batch.targets[0] >= 0;
  ASSERT_EQ(scored.sum().item<int64_t>(), 5);  // "this" + <|end|>
  double expected = 0;
  for (int64_t i = 0; i < 13; ++i) {
    const int64_t t = batch.targets[0][i].item<int64_t>();
    if (t < 0) {
      EXPECT_EQ(logits.grad()[0][i].abs().max().item<double>(), 0.0) << "position " << i;
      continue;
    }
    expected -= torch::log_softmax(logits[0][i].detach(), -1)[t].item<double>();
  }
  EXPECT_NEAR(loss.item<double>(), expected / 5, 1e-12);
  // Scrambling the logits at every unscored position leaves the loss bit for bit unchanged.
  torch::Tensor other = logits.detach().clone();
  other.index_put_({0, scored.logical_not()}, torch::randn({13 - 5, 260}, torch::kFloat64));
  EXPECT_EQ(ScoreBatch(other, batch, false).loss.item<double>(), loss.item<double>());
}

TEST(Schedule, WarmupThenCosine) {
  v1::OptimizerConfig o;
  o.set_lr(1e-3);
  o.set_min_lr(1e-4);
  o.set_warmup_steps(10);
  EXPECT_DOUBLE_EQ(LearningRateAt(o, 100, 0), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(o, 100, 9), 1e-3);
  EXPECT_NEAR(LearningRateAt(o, 100, 10), 1e-3, 1e-12);
  EXPECT_NEAR(LearningRateAt(o, 100, 55), 0.5 * (1e-3 + 1e-4), 1e-12);
  EXPECT_NEAR(LearningRateAt(o, 100, 100), 1e-4, 1e-12);
}

TEST(Corpus, DeterministicBySeed) {
  EXPECT_EQ(GenerateCorpus(5, 4096), GenerateCorpus(5, 4096));
  EXPECT_NE(GenerateCorpus(5, 4096), GenerateCorpus(6, 4096));
}

TEST(WindowSampler, StateRestoresTheCursor) {
  const std::vector<uint32_t> ids = data::EncodeBytes(GenerateCorpus(1, 4096));
  auto tokens = std::make_shared<VectorTokenStream>(std::vector<int64_t>(ids.begin(), ids.end()));
  WindowSampler a(tokens, 16, 7);
  a.Next(2);
  const std::string state = a.State();
  TrainBatch x1 = a.Next(2);
  WindowSampler b(tokens, 16, 99);
  ASSERT_TRUE(b.Restore(state).ok());
  TrainBatch x2 = b.Next(2);
  EXPECT_TRUE(torch::equal(x1.inputs, x2.inputs));
  EXPECT_TRUE(torch::equal(x1.inputs.narrow(1, 1, 15), x1.targets.narrow(1, 0, 15)));
  EXPECT_FALSE(b.Restore("garbage").ok());
}

TEST(SplitSampler, EpochsAndStateRestoreTheCursor) {
  auto split = std::make_shared<TaskSplit>();
  for (int64_t i = 0; i < 10; ++i) split->examples.push_back({{i, i}, {1, 1}, {}, {}});
  SplitSampler a(split, 7);
  // One pass holds every example once; a batch past the end wraps into a new permutation.
  std::vector<int64_t> seen;
  for (int k = 0; k < 3; ++k) {
    TrainBatch x = a.Next(3);
    for (int64_t r = 0; r < 3; ++r) seen.push_back(x.inputs[r][0].item<int64_t>());
  }
  std::vector<int64_t> sorted = seen;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::unique(sorted.begin(), sorted.end()), sorted.end());  // 9 distinct of 10
  TrainBatch wrap = a.Next(3);  // the 10th, then two of pass 2
  EXPECT_EQ(a.pass(), 2);
  EXPECT_EQ(a.cursor(), 2);
  const std::string state = a.State();
  TrainBatch x1 = a.Next(4);
  SplitSampler b(split, 99);
  ASSERT_TRUE(b.Restore(state).ok());
  TrainBatch x2 = b.Next(4);
  EXPECT_TRUE(torch::equal(x1.inputs, x2.inputs));
  EXPECT_EQ(b.pass(), a.pass());
  EXPECT_FALSE(b.Restore("garbage").ok());
}

}  // namespace
}  // namespace loom::trainer
