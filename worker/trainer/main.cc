// loom-train: the trainer process. Subcommands:
//   train      train a model on the generated corpus (standalone, CPU or GPU)
//   attention  run one attention layer's forward from safetensors files (interop contract)
//   generate | score | logits  a checkpoint's model at inference
//   export-hf | import-hf      Hugging Face model folders (interop/hf_folder.h)
//   plugins    list the plugins found on the search path, and those that failed to load
//   devices    report CPU threads and CUDA devices
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/cli_args.h"
#include "base/cpu_process.h"
#include "base/read_file.h"
#include "base/status_macros.h"
#include "interop/hf_folder.h"
#include "loom/exit_codes.h"
#include "loom/proto_json.h"
#include "loom/spec_overrides.h"
#include "storage/checkpoint.h"
#include "storage/checkpoint_store.h"
#include "storage/confined_files.h"
#include "worker/trainer/corpus.h"
#include "worker/trainer/devices.h"
#include "worker/trainer/inference_commands.h"
#include "worker/trainer/lease.h"
#include "worker/trainer/model.h"
#include "worker/trainer/plugin_factory.h"
#include "worker/trainer/plugin_loader.h"
#include "worker/trainer/tensor_io.h"
#include "worker/trainer/test_hooks.h"
#include "worker/trainer/trainer.h"

namespace loom::trainer {
namespace {

constexpr char kUsage[] = R"(usage: loom-train <command> [flags]

commands:
  train       train a decoder (job spec: docs/jobs.md)
                --spec job.json, or --preset NAME (tiny-cpu | micro | paper-2.4b; default
                tiny-cpu) with optional --model model.json
                overrides: --steps N --batch B --grad-accum K --seq-len N --lr X --min-lr X
                --warmup N --seed S --log-every K --threads T --name NAME
                --checkpoint-dir DIR --checkpoint-every N --checkpoint-every-seconds S
                --metrics-port P --metrics-jsonl F
                --resume DIR (continue exactly) | --init-from DIR (weights only)
                --resume-if-any DIR (newest intact checkpoint there, else a fresh start or
                  --init-from; damaged ones are skipped)   --no-retention (keep every checkpoint)
                --stop-after N (stop at step N with a checkpoint)  --print-spec
                --storage-root DIR (open the data, tokenizer, reasoning-eval and --init-from
                  files only beneath DIR: a symlink out of it is refused; agents pass the
                  coordinator's)
                --save-weights out.safetensors
                --set PATH=VALUE (repeatable, after the flags above): any spec field, e.g.
                  optimizer.lr=3e-4 model.n_layers=4 data.task_options.ops=2-4 (docs/jobs.md)
  attention   one attention layer's forward from files
                --plugin NAME --config layer.json --weights w.safetensors
                --input x.safetensors --output y.safetensors
  describe    per-layer attention kind, parameters and forward FLOPs/token of a model
                --preset NAME or --model model.json, --context N (default max_seq_len)
  generate    continue a prompt with a checkpoint's model (the batch generator; JSON out)
                --checkpoint DIR (a step directory or a checkpoint root: its newest)
                --prompt TEXT | --prompt-tokens 1,2,3 | --chat TEXT (a user turn, chat template)
                --max-new-tokens N (16)
                --greedy | --temperature T --top-p P --seed S
  score       log-probability of each token given the ones before (one full forward; JSON)
                --checkpoint DIR  --tokens 1,2,3 | --text TEXT
  logits      the full logits [N, V] of one forward pass, as a safetensors file ("logits")
                --checkpoint DIR  --tokens 1,2,3 | --text TEXT  --output F  --dtype float32|float64
  export-hf   a checkpoint as a Hugging Face model folder (docs/interop.md): Llama, Mistral
              (sliding window) or Loom-IHA (with modeling_loom_iha.py)
                --checkpoint DIR --out DIR  [--max-shard-bytes N (5e9)]
  import-hf   a Llama / Mistral / Loom-IHA safetensors folder as a checkpoint for --init-from;
              writes DIR/step-00000000/ and DIR/model.json
                --from DIR --out DIR  [--rope-pairing half|interleaved] [--max-seq-len N]
  plugins     list loadable plugins and load errors
  devices     report CPU threads and CUDA devices
common flags: --plugin-dir DIR[:DIR...] (default: $LOOM_PLUGIN_PATH, then <exe>/../lib/loom/plugins)
)";

// Loads plugins from --plugin-dir or the default search path (LoadPluginDirectories).
absl::Status LoadPlugins(const CliArgs& args, PluginLoader& loader, bool verbose) {
  return LoadPluginDirectories(args.Get("plugin-dir"), loader, verbose);
}

absl::Status ApplyThreads(const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 0, 0, 1024));
  if (threads > 0) torch::set_num_threads(static_cast<int>(threads));
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelConfig> ModelFromArgs(const CliArgs& args) {
  if (args.Has("preset") && args.Has("model")) {
    return absl::InvalidArgumentError("--preset and --model are exclusive");
  }
  v1::ModelConfig config;
  if (args.Has("model")) {
    LOOM_ASSIGN_OR_RETURN(std::string text, ReadFile(args.Get("model"), "--model"));
    LOOM_RETURN_IF_ERROR(ParseJsonMessage(text, args.Get("model"), &config));
    return config;
  }
  return ModelPreset(args.Get("preset", "tiny-cpu"));
}

// `train`'s flags that each set spec fields (spec_overrides.h), within the ranges they accept.
// They apply in this order, after the spec or preset and before --set.
struct FieldFlag {
  const char* flag;  // without the leading --
  const char* path;  // the JobSpec field it sets
  ValueLimits limits;
};
const FieldFlag kFieldFlags[] = {
    {"steps", "steps", ValueLimits::Integer(1, 1000000000)},
    {"batch", "micro_batch", ValueLimits::Integer(1, 65536)},
    {"grad-accum", "grad_accum", ValueLimits::Integer(1, 65536)},
    {"seq-len", "seq_len", ValueLimits::Integer(1, 1 << 20)},
    {"lr", "optimizer.lr", ValueLimits::Real(1e-12, 10)},
    {"min-lr", "optimizer.min_lr", ValueLimits::Real(0, 10)},
    {"warmup", "optimizer.warmup_steps", ValueLimits::Integer(0, 1000000000)},
    {"seed", "seed", ValueLimits::Integer(1, INT64_MAX)},
    {"seed", "model.init_seed", ValueLimits::Integer(1, INT64_MAX)},
    {"log-every", "metrics.log_every", ValueLimits::Integer(1, 1000000000)},
    {"threads", "threads", ValueLimits::Integer(1, 1024)},
    {"checkpoint-dir", "checkpoint.dir", {}},
    {"checkpoint-every", "checkpoint.interval", ValueLimits::Integer(1, 1000000000)},
    {"checkpoint-every-seconds", "checkpoint.interval_seconds", ValueLimits::Integer(1, 31536000)},
    {"metrics-port", "metrics.port", ValueLimits::Integer(-1, 65535)},
    {"metrics-jsonl", "metrics.jsonl", {}},
    {"name", "name", {}},
};

// The spec `train` starts from: --spec job.json, else --preset (default tiny-cpu) with --model
// replacing its model.
absl::StatusOr<v1::JobSpec> BaseJobFromArgs(const CliArgs& args) {
  if (args.Has("spec")) {
    if (args.Has("preset") || args.Has("model")) {
      return absl::InvalidArgumentError("--spec is exclusive with --preset and --model");
    }
    return ReadJobSpecFile(args.Get("spec"));
  }
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec spec, JobPreset(args.Get("preset", "tiny-cpu")));
  if (args.Has("model")) {
    LOOM_ASSIGN_OR_RETURN(std::string text, ReadFile(args.Get("model"), "--model"));
    v1::ModelConfig model;
    LOOM_RETURN_IF_ERROR(ParseJsonMessage(text, args.Get("model"), &model));
    *spec.mutable_model() = model;
  }
  return spec;
}

// The flags of kFieldFlags that were given. A preset's warm-up is sized for its own run
// length: --steps without --spec (or --warmup) shortens it as a spec's preset would.
absl::Status ApplyFieldFlags(const CliArgs& args, v1::JobSpec* spec) {
  for (const FieldFlag& f : kFieldFlags) {
    if (!args.Has(f.flag)) continue;
    LOOM_RETURN_IF_ERROR(
        SetFieldFromText(spec, f.path, args.Get(f.flag), absl::StrCat("--", f.flag), f.limits));
  }
  if (args.Has("steps") && !args.Has("spec") && !args.Has("warmup")) {
    spec->mutable_optimizer()->set_warmup_steps(
        PresetWarmup(spec->optimizer().warmup_steps(), spec->steps()));
  }
  return absl::OkStatus();
}

// The model of an eval job comes from the --init-from checkpoint when the spec leaves it out.
absl::Status FillEvalModelFromCheckpoint(const CliArgs& args, v1::JobSpec* spec) {
  if (spec->kind() != "eval" || spec->has_model() || !args.Has("init-from")) {
    return absl::OkStatus();
  }
  std::string dir = args.Get("init-from");
  if (storage::IsRemoteLocation(dir)) {
    auto text = storage::ReadManifestText(dir);
    if (absl::IsNotFound(text.status())) {  // a root: its newest step
      LOOM_ASSIGN_OR_RETURN(auto store, storage::OpenCheckpointStore(dir));
      LOOM_ASSIGN_OR_RETURN(auto refs, store->List());
      if (refs.empty())
        return absl::NotFoundError(absl::StrCat("--init-from: no checkpoint in ", dir));
      text = storage::ReadManifestText(refs.back().dir);
    }
    if (!text.ok())
      return absl::Status(text.status().code(),
                          absl::StrCat("--init-from: ", text.status().message()));
    return FillModelFromManifest(spec, *text, dir);
  }
  if (!std::filesystem::exists(std::filesystem::path(dir) / "manifest.json")) {
    LOOM_ASSIGN_OR_RETURN(auto refs, storage::ListCheckpoints(dir));
    if (refs.empty())
      return absl::NotFoundError(absl::StrCat("--init-from: no checkpoint in ", dir));
    dir = refs.back().dir;
  }
  const std::string manifest = (std::filesystem::path(dir) / "manifest.json").string();
  auto text = storage::ReadConfinedFile(manifest, 64 << 20);
  if (!text.ok())
    return absl::Status(text.status().code(),
                        absl::StrCat("--init-from: ", text.status().message()));
  return FillModelFromManifest(spec, *text, manifest);
}

// The job for `train`: the spec or preset, then the field flags, then each --set PATH=VALUE.
absl::StatusOr<v1::JobSpec> JobFromArgs(const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec spec, BaseJobFromArgs(args));
  LOOM_RETURN_IF_ERROR(ApplyFieldFlags(args, &spec));
  LOOM_RETURN_IF_ERROR(ApplySetFlags(&spec, args.GetAll("set")));
  LOOM_RETURN_IF_ERROR(FillEvalModelFromCheckpoint(args, &spec));
  return ResolveJobSpec(spec);
}

// Every flag `train` takes besides the switches and --set.
std::set<std::string> TrainFlags() {
  std::set<std::string> flags = {"spec",          "preset",      "model",     "plugin-dir",
                                 "save-weights",  "resume",      "init-from", "stop-after",
                                 "resume-if-any", "storage-root"};
  for (const FieldFlag& f : kFieldFlags) flags.insert(f.flag);
  return flags;
}

absl::Status RunTrain(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 2, TrainFlags(),
                                                     {"print-spec", "no-retention"}, {"set"}));
  LOOM_RETURN_IF_ERROR(storage::ConfineReadsTo(args.Get("storage-root")));
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec spec, JobFromArgs(args));
  if (args.Has("print-spec")) {
    std::cout << MessageToJsonText(spec, /*pretty=*/true);
    return absl::OkStatus();
  }
  TrainerOptions options;
  options.resume = args.Get("resume");
  options.init_from = args.Get("init-from");
  options.resume_if_any = args.Get("resume-if-any");
  options.apply_retention = !args.Has("no-retention");
  LOOM_ASSIGN_OR_RETURN(options.test, TestHooksFromEnvironment());
  StartLeaseWatchdog();  // a rank of a service job: stop when the agent's lease runs out
  LOOM_ASSIGN_OR_RETURN(options.stop_after, args.GetInt("stop-after", 0, 1, 1000000000));
  options.log = &std::cout;
  options.progress_bar = ::isatty(STDOUT_FILENO) != 0;
  PluginLoader loader;
  LOOM_RETURN_IF_ERROR(LoadPlugins(args, loader, false));
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(spec, loader, options));
  LOOM_ASSIGN_OR_RETURN(TrainSummary summary, trainer->Run());
  if (trainer->rank() != 0) return absl::OkStatus();  // rank 0 reports for the job
  if (summary.first_eval_loss > 0) {
    std::cout << absl::StrFormat("eval loss: %.4f -> %.4f over %d steps\n", summary.first_eval_loss,
                                 summary.last_eval_loss, summary.steps.size());
  }
  if (args.Has("save-weights")) {
    LOOM_RETURN_IF_ERROR(SaveTensors(args.Get("save-weights"), ModuleTensors(trainer->model())));
    std::cout << "weights written to " << args.Get("save-weights") << "\n";
  }
  return absl::OkStatus();
}

// The --config of `attention`: its plugin must agree with --plugin (or be left out) and its
// shape must make sense.
absl::StatusOr<v1::AttentionLayerConfig> ReadAttentionLayerConfig(const std::string& path,
                                                                  const std::string& plugin) {
  LOOM_ASSIGN_OR_RETURN(std::string text, ReadFile(path, "--config"));
  v1::AttentionLayerConfig config;
  LOOM_RETURN_IF_ERROR(ParseJsonMessage(text, path, &config));
  if (!config.attention().plugin().empty() && config.attention().plugin() != plugin) {
    return absl::InvalidArgumentError(absl::StrCat("attention.plugin: '",
                                                   config.attention().plugin(),
                                                   "' disagrees with --plugin '", plugin, "'"));
  }
  config.mutable_attention()->set_plugin(plugin);
  if (config.d_model() <= 0) return absl::InvalidArgumentError("d_model: must be >= 1");
  if (config.n_heads() <= 0) return absl::InvalidArgumentError("n_heads: must be >= 1");
  if (config.head_dim() < 0) return absl::InvalidArgumentError("head_dim: must be >= 0");
  if (config.head_dim() == 0 && config.d_model() % config.n_heads() != 0) {
    return absl::InvalidArgumentError(
        "n_heads: d_model is not divisible by n_heads (or set head_dim)");
  }
  if (config.layer_index() < 0) return absl::InvalidArgumentError("layer_index: must be >= 0");
  return config;
}

absl::StatusOr<torch::ScalarType> AttentionDtype(const v1::AttentionLayerConfig& config) {
  if (config.dtype().empty() || config.dtype() == "float32") return torch::kFloat32;
  if (config.dtype() == "float64") return torch::kFloat64;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: '", config.dtype(), "' is not float32 | float64"));
}

AttentionShape AttentionShapeOf(const v1::AttentionLayerConfig& config) {
  AttentionShape shape;
  shape.d_model = config.d_model();
  shape.n_heads = config.n_heads();
  shape.head_dim = config.head_dim() > 0 ? config.head_dim() : config.d_model() / config.n_heads();
  shape.causal = config.causal();
  shape.bias = config.bias();
  shape.rope_theta = config.rope_theta();
  shape.layer_index = config.layer_index();
  shape.n_layers = config.n_layers() > 0 ? config.n_layers() : config.layer_index() + 1;
  return shape;
}

// The --input file: x [B, N, d_model] and optional positions (default 0..N-1).
absl::StatusOr<std::pair<torch::Tensor, AttentionInputs>> ReadAttentionInput(
    const std::string& path, const AttentionShape& shape) {
  LOOM_ASSIGN_OR_RETURN(auto inputs, LoadTensors(path));
  auto x_it = inputs.find("x");
  if (x_it == inputs.end()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": needs a tensor named 'x'"));
  }
  const torch::Tensor& x = x_it->second;
  if (x.dim() != 3 || x.size(2) != shape.d_model || !x.is_floating_point()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": x must be a floating [B, N, ", shape.d_model, "] tensor"));
  }
  AttentionInputs attention_inputs;
  if (auto p = inputs.find("positions"); p != inputs.end()) {
    attention_inputs.positions = p->second;
  } else {
    attention_inputs.positions = torch::arange(x.size(1), torch::kInt64);
  }
  return std::make_pair(x, attention_inputs);
}

// The layer of --plugin with --weights loaded, in `dtype`.
absl::StatusOr<AttentionLayerPtr> LoadAttentionLayer(const CliArgs& args,
                                                     const v1::AttentionLayerConfig& config,
                                                     const AttentionShape& shape,
                                                     torch::ScalarType dtype,
                                                     const std::string& weights_path) {
  PluginLoader loader;
  LOOM_RETURN_IF_ERROR(LoadPlugins(args, loader, false));
  LOOM_ASSIGN_OR_RETURN(AttentionLayerPtr layer,
                        CreateAttentionLayer(loader, config.attention(), shape));
  layer->to(dtype);
  LOOM_ASSIGN_OR_RETURN(auto weights, LoadTensors(weights_path));
  if (absl::Status s = LoadIntoModule(*layer, weights); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(weights_path, ": ", s.message()));
  }
  return layer;
}

absl::Status RunAttention(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 2,
                                                     {"plugin", "config", "weights", "input",
                                                      "output", "plugin-dir", "threads"}));
  LOOM_RETURN_IF_ERROR(ApplyThreads(args));
  LOOM_ASSIGN_OR_RETURN(std::string plugin, args.Require("plugin"));
  LOOM_ASSIGN_OR_RETURN(std::string config_path, args.Require("config"));
  LOOM_ASSIGN_OR_RETURN(std::string weights_path, args.Require("weights"));
  LOOM_ASSIGN_OR_RETURN(std::string input_path, args.Require("input"));
  LOOM_ASSIGN_OR_RETURN(std::string output_path, args.Require("output"));
  LOOM_ASSIGN_OR_RETURN(v1::AttentionLayerConfig config,
                        ReadAttentionLayerConfig(config_path, plugin));
  LOOM_ASSIGN_OR_RETURN(torch::ScalarType dtype, AttentionDtype(config));
  const AttentionShape shape = AttentionShapeOf(config);
  LOOM_ASSIGN_OR_RETURN(AttentionLayerPtr layer,
                        LoadAttentionLayer(args, config, shape, dtype, weights_path));
  LOOM_ASSIGN_OR_RETURN(auto input, ReadAttentionInput(input_path, shape));
  const torch::Tensor& x = input.first;
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    try {
      y = layer->forward(x.to(dtype), input.second);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("forward failed: ", e.what()));
    }
  }
  LOOM_RETURN_IF_ERROR(SaveTensors(output_path, {{"y", y}}));
  std::cout << "attention " << plugin << ": x " << x.sizes() << " -> y " << y.sizes()
            << " written to " << output_path << "\n";
  return absl::OkStatus();
}

absl::Status RunDescribe(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args, CliArgs::Parse(argc, argv, 2, {"preset", "model", "context", "plugin-dir"}));
  LOOM_ASSIGN_OR_RETURN(v1::ModelConfig config, ModelFromArgs(args));
  PluginLoader loader;
  LOOM_RETURN_IF_ERROR(LoadPlugins(args, loader, false));
  LOOM_ASSIGN_OR_RETURN(std::shared_ptr<Transformer> model, Transformer::Create(config, loader));
  const v1::ModelConfig& c = model->config();
  LOOM_ASSIGN_OR_RETURN(int64_t context,
                        args.GetInt("context", c.max_seq_len(), 1, c.max_seq_len()));
  const std::vector<v1::AttentionConfig> layers = ExpandSchedule(c);
  const std::vector<double> flops = model->AttentionFlopsPerToken(context);
  std::printf("%-6s %-14s %8s %12s %16s\n", "layer", "attention", "window", "params",
              "FLOPs/token");
  auto blocks = model->named_children()["layers"]->children();
  double sum = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    int64_t params = 0;
    for (const auto& p : blocks[i]->named_children()["attention"]->parameters())
      params += p.numel();
    std::printf("%-6zu %-14s %8lld %12lld %16.4g\n", i, layers[i].plugin().c_str(),
                static_cast<long long>(layers[i].window()), static_cast<long long>(params),
                flops[i]);
    sum += flops[i];
  }
  std::printf("attention layers: mean %.4g FLOPs/token at context %lld\n", sum / layers.size(),
              static_cast<long long>(context));
  std::printf("model: %lld parameters, %.4g forward FLOPs/token (x3 for a training step)\n",
              static_cast<long long>(model->NumParameters()), model->ForwardFlopsPerToken(context));
  return absl::OkStatus();
}

// generate | score | logits: a checkpoint's model as inference_commands.h describes.
absl::Status RunInference(const std::string& command, int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args, CliArgs::Parse(argc, argv, 2,
                                   {"checkpoint", "prompt", "prompt-tokens", "max-new-tokens",
                                    "temperature", "top-p", "seed", "tokens", "text", "plugin-dir",
                                    "threads", "output", "dtype", "chat"},
                                   {"greedy"}));
  LOOM_RETURN_IF_ERROR(ApplyThreads(args));
  PluginLoader loader;
  LOOM_RETURN_IF_ERROR(LoadPlugins(args, loader, false));
  if (command == "logits") return RunLogitsCommand(args, loader, std::cout);
  return command == "generate" ? RunGenerateCommand(args, loader, std::cout)
                               : RunScoreCommand(args, loader, std::cout);
}

// export-hf | import-hf: Hugging Face model folders (no model is built; bytes are copied).
absl::Status RunHuggingFace(const std::string& command, int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 2,
                                                     {"checkpoint", "out", "max-shard-bytes",
                                                      "from", "rope-pairing", "max-seq-len"}));
  LOOM_ASSIGN_OR_RETURN(std::string out, args.Require("out"));
  if (command == "export-hf") {
    interop::ExportOptions o;
    LOOM_ASSIGN_OR_RETURN(o.checkpoint, args.Require("checkpoint"));
    o.out_dir = out;
    LOOM_ASSIGN_OR_RETURN(int64_t shard,
                          args.GetInt("max-shard-bytes", 5'000'000'000, 1, int64_t{1} << 50));
    o.max_shard_bytes = static_cast<uint64_t>(shard);
    LOOM_ASSIGN_OR_RETURN(interop::ExportSummary s, interop::ExportHuggingFace(o));
    std::cout << "exported " << s.checkpoint_dir << " (step " << s.step << ") as " << s.architecture
              << ": " << s.tensors << " tensors, " << s.bytes << " bytes in " << s.shards
              << " file(s) -> " << out << "\n";
    return absl::OkStatus();
  }
  interop::ImportOptions o;
  LOOM_ASSIGN_OR_RETURN(o.in_dir, args.Require("from"));
  o.out_root = out;
  o.rope_pairing = args.Get("rope-pairing", "half");
  LOOM_ASSIGN_OR_RETURN(o.max_seq_len, args.GetInt("max-seq-len", 0, 0, 1 << 24));
  LOOM_ASSIGN_OR_RETURN(interop::ImportSummary s, interop::ImportHuggingFace(o));
  std::cout << "imported " << s.architecture << " from " << o.in_dir << ": " << s.tensors
            << " tensors -> " << s.checkpoint_dir << " (train with --model " << out
            << "/model.json --init-from " << s.checkpoint_dir << ")\n";
  return absl::OkStatus();
}

absl::Status RunPlugins(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 2, {"plugin-dir"}));
  PluginLoader loader;
  absl::Status s = LoadPlugins(args, loader, true);
  for (const auto& [name, p] : loader.plugins()) {
    std::cout << name << "\t"
              << (p.plugin->kind == LOOM_PLUGIN_KIND_ATTENTION ? "attention" : "sft") << "\t"
              << p.plugin->description << "\t" << p.path << "\n";
  }
  return s;
}

absl::Status RunDevices(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 2, {}, {"self-test"}));
  DeviceReport r = DetectDevices();
  std::cout << "cpu: " << r.cpu_threads << " LibTorch threads\n";
  std::cout << "cuda: " << (r.cuda_compiled ? "compiled in" : "not compiled") << ", "
            << r.cuda_devices << " device(s)";
  if (r.cuda_devices == 0) std::cout << " (" << r.cuda_status << "; training runs on the CPU)";
  std::cout << "\n";
  for (size_t i = 0; i < r.cuda_names.size(); ++i)
    std::cout << "  [" << i << "] " << r.cuda_names[i] << "\n";
  std::cout << "libtorch cuda: " << (r.torch_cuda ? "available" : "not available") << "\n";
  if (args.Has("self-test")) {
    for (int i = 0; i < r.cuda_devices; ++i) {
      LOOM_RETURN_IF_ERROR(CudaSelfTest(i));
      std::cout << "  [" << i << "] self-test passed\n";
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::trainer

int main(int argc, char** argv) {
  using namespace loom::trainer;
  loom::SetUpCpuProcess(argv);  // before any matmul or large allocation (base/cpu_process.h)
  if (argc < 2 || std::string(argv[1]) == "help" || std::string(argv[1]) == "--help") {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  // SIGTERM (preemption, walltime, the agent stopping): finish the step, checkpoint, exit 76.
  struct sigaction on_term {};
  on_term.sa_handler = [](int) { RequestStop(); };
  sigemptyset(&on_term.sa_mask);
  sigaction(SIGTERM, &on_term, nullptr);
  absl::Status status;
  try {
    if (command == "train") {
      status = RunTrain(argc, argv);
    } else if (command == "attention") {
      status = RunAttention(argc, argv);
    } else if (command == "describe") {
      status = RunDescribe(argc, argv);
    } else if (command == "generate" || command == "score" || command == "logits") {
      status = RunInference(command, argc, argv);
    } else if (command == "export-hf" || command == "import-hf") {
      status = RunHuggingFace(command, argc, argv);
    } else if (command == "plugins") {
      status = RunPlugins(argc, argv);
    } else if (command == "devices") {
      status = RunDevices(argc, argv);
    } else {
      std::cerr << "loom-train: unknown command '" << command << "'\n" << kUsage;
      return 2;
    }
  } catch (const std::exception& e) {
    status = absl::InternalError(e.what());
  }
  if (!status.ok()) {
    std::cerr << "loom-train " << command << ": " << status.message() << "\n";
    if (absl::IsCancelled(status)) return loom::kExitStopped;  // stopped by SIGTERM, checkpointed
    return absl::IsInvalidArgument(status) || absl::IsNotFound(status) ? loom::kExitBadInput : 1;
  }
  return 0;
}
