#include "worker/trainer/activation_checkpoint.h"

#include "worker/trainer/autocast.h"

namespace loom::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward needs besides the saved input: the function and the very tensors it reads
// (the saved copies of leaves are not the variables the recomputed graph uses).
struct RecomputeState : torch::CustomClassHolder {
  TensorFn fn;
  std::vector<torch::Tensor> params;
  AutocastState autocast;  // the recomputation runs in the forward's precision
};

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               torch::TensorList /*params: inputs for autograd only*/,
                               const c10::intrusive_ptr<RecomputeState>& state) {
    ctx->save_for_backward({x});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return state->fn(x);  // autograd is off inside a custom function's forward
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    auto state =
        c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data["state"].toCapsule());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      AutocastScope precision(state->autocast);
      y = state->fn(x);
    }
    std::vector<torch::Tensor> inputs = {x};
    inputs.insert(inputs.end(), state->params.begin(), state->params.end());
    variable_list grads = torch::autograd::grad({y}, inputs, {grad_output[0]},
                                                /*retain_graph=*/false, /*create_graph=*/false,
                                                /*allow_unused=*/true);
    grads.emplace_back();  // the state argument has no gradient
    return grads;
  }
};

}  // namespace

torch::Tensor Recompute(const TensorFn& fn, const torch::Tensor& x,
                        const std::vector<torch::Tensor>& params) {
  bool needs_grad = x.requires_grad();
  for (const auto& p : params) needs_grad |= p.requires_grad();
  if (!torch::GradMode::is_enabled() || !needs_grad) return fn(x);
  auto state = c10::make_intrusive<RecomputeState>();
  state->fn = fn;
  state->params = params;
  state->autocast = AutocastState::Current();
  return RecomputeFunction::apply(x, torch::TensorList(params), state);
}

}  // namespace loom::trainer
