#include "loom/trainer_events.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace loom {
namespace {

TEST(TrainerEvents, StepLineKeepsTheLayoutReadersRelyOn) {
  v1::TrainerEvent e;
  v1::StepEvent* s = e.mutable_step();
  s->set_step(7);
  s->set_loss(2.5);
  s->set_lr(1e-3);
  s->set_tokens_seen(int64_t{1} << 40);  // past 2^32: a JSON number, not protobuf's string
  s->set_time_unix_ms(1700000000123);
  const std::string line = TrainerEventLine(e);
  EXPECT_EQ(line.rfind(R"({"event":"step","step":7,"loss":2.5,"lr":0.001,)", 0), 0u) << line;
  EXPECT_NE(line.find(R"("tokens_seen":1099511627776)"), std::string::npos) << line;
  EXPECT_NE(line.find(R"("skipped":false)"), std::string::npos) << line;  // no presence: written
  EXPECT_EQ(line.find("loss_scale"), std::string::npos) << line;  // optional and unset: absent
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(TrainerEvents, RoundTripsEveryKind) {
  v1::TrainerEvent step;
  step.mutable_step()->set_step(3);
  step.mutable_step()->set_loss_scale(65536);
  step.mutable_step()->set_overflowed(true);
  v1::TrainerEvent eval;
  eval.mutable_eval()->set_step(4);
  eval.mutable_eval()->set_split("validation");
  eval.mutable_eval()->set_epoch(2);
  eval.mutable_eval()->set_exact_match(0.25);
  v1::TrainerEvent ckpt;
  ckpt.mutable_checkpoint()->set_dir("/tmp/c/step-00000004");
  ckpt.mutable_checkpoint()->set_bytes(uint64_t{1} << 50);
  v1::TrainerEvent skipped;
  skipped.mutable_checkpoint_skipped()->set_reason("shard 0: checksum \"mismatch\"\n");
  v1::TrainerEvent resumed;
  resumed.mutable_resumed()->set_step(0);
  v1::TrainerEvent reasoning;
  reasoning.mutable_reasoning_eval()->set_task("arith");
  reasoning.mutable_reasoning_eval()->set_details("/tmp/r.json");
  for (int i = 0; i < 3; ++i) {  // per-problem scores: repeated fields, as JSON arrays
    reasoning.mutable_reasoning_eval()->add_problem_samples(4);
    reasoning.mutable_reasoning_eval()->add_problem_correct(i);
    reasoning.mutable_reasoning_eval()->add_problem_majority_correct(i == 2);
  }
  EXPECT_NE(TrainerEventLine(reasoning).find(R"("problem_correct":[0,1,2])"), std::string::npos)
      << TrainerEventLine(reasoning);
  for (const v1::TrainerEvent& e : {step, eval, ckpt, skipped, resumed, reasoning}) {
    auto back = ParseTrainerEventLine(TrainerEventLine(e));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->SerializeAsString(), e.SerializeAsString()) << TrainerEventLine(e);
  }
}

TEST(TrainerEvents, NonFiniteNumbersAreNullAndReadAsZero) {
  v1::TrainerEvent e;
  e.mutable_step()->set_step(5);
  e.mutable_step()->set_loss(std::nan(""));
  e.mutable_step()->set_grad_norm(std::numeric_limits<double>::infinity());
  const std::string line = TrainerEventLine(e);
  EXPECT_NE(line.find(R"("loss":null)"), std::string::npos) << line;
  EXPECT_NE(line.find(R"("grad_norm":null)"), std::string::npos) << line;
  auto back = ParseTrainerEventLine(line);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step().step(), 5);
  EXPECT_EQ(back->step().loss(), 0);
}

TEST(TrainerEvents, HostileLinesAreRefusedNotThrown) {
  for (const char* line :
       {"", "not json", "[1,2]", R"({"step":1})", R"({"event":7})", R"({"event":"kind"})",
        R"({"event":"no_such_event"})", R"({"event":"step","step":"x"})",
        R"({"event":"step","step":1e300})", R"({"event":"eval","split":{"a":1}})",
        R"({"event":"checkpoint","bytes":-1})", "{\"event\":\"step\",\"loss\":\xff}"}) {
    EXPECT_FALSE(ParseTrainerEventLine(line).ok()) << line;
  }
  // Fields a newer trainer adds are ignored by an older reader.
  auto newer = ParseTrainerEventLine(R"({"event":"resumed","step":2,"dir":"d","new":[1]})");
  ASSERT_TRUE(newer.ok()) << newer.status();
  EXPECT_EQ(newer->resumed().dir(), "d");
}

TEST(TrainerEvents, InvalidUtf8IsReplacedNotThrown) {
  v1::TrainerEvent e;
  e.mutable_checkpoint_skipped()->set_reason(std::string("bad \xff byte"));
  const std::string line = TrainerEventLine(e);
  auto back = ParseTrainerEventLine(line);
  ASSERT_TRUE(back.ok()) << back.status() << line;
  EXPECT_NE(back->checkpoint_skipped().reason().find("bad"), std::string::npos);
}

}  // namespace
}  // namespace loom
