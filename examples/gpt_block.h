#pragma once

// The transformer block train_pp and train_gpt share: pre-LayerNorm, causal multi-head
// self-attention, then a 4x GELU MLP, each added to the residual stream:
//   h = x + proj(attention(ln1(x))),  out = h + mlp(ln2(h)).
// [batch, T, width] -> [batch, T, width].

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace sinew_example {

struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(int64_t width, int64_t heads)
      : width(width),
        heads(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        qkv(register_module("qkv", torch::nn::Linear(width, 3 * width))),
        proj(register_module("proj", torch::nn::Linear(width, width))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc(register_module("fc", torch::nn::Linear(width, 4 * width))),
        out(register_module("out", torch::nn::Linear(4 * width, width))) {}

  at::Tensor forward(const at::Tensor& x) {
    const int64_t T = x.size(1);
    return block(x,
                 at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1));
  }

  // The block with attention from position i to j blocked where `blocked` (bool, broadcast to
  // [batch, heads, T, T]) is true; every position must see itself.
  at::Tensor block(const at::Tensor& x, const at::Tensor& blocked) {
    const int64_t B = x.size(0), T = x.size(1), hd = width / heads;
    auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
    auto split = [&](const at::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    at::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(blocked, -std::numeric_limits<double>::infinity());
    at::Tensor attn = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({B, T, width});
    at::Tensor h = x + proj->forward(attn);
    return h + out->forward(at::gelu(fc->forward(ln2->forward(h))));
  }

  int64_t width, heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, out;
};
TORCH_MODULE(GptBlock);

}  // namespace sinew_example
