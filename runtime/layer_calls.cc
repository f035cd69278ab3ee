#include "sinew/runtime/layer_calls.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

namespace {

std::string describe(const pipeline::Activation& a) {
  if (!a.list) return "one tensor";
  return "a list of " + std::to_string(a.tensors.size()) + " tensors";
}

}  // namespace

pipeline::Activation runLayers(torch::nn::Sequential layers, const pipeline::Activation& x) {
  if (layers->is_empty()) SINEW_THROW(InvalidArgument, "runLayers: no layers to run");
  const auto names = layers->named_children();
  pipeline::Activation a = x;
  size_t i = 0;
  for (auto it = layers->begin(); it != layers->end(); ++it, ++i) {
    torch::nn::AnyValue in =
        a.list ? torch::nn::AnyValue(a.tensors) : torch::nn::AnyValue(a.single("a layer's input"));
    auto call = [&]() -> torch::nn::AnyValue {
      try {
        return it->any_forward(std::move(in));
      } catch (const c10::Error& e) {
        // A forward of another signature is refused before it runs, with AnyModule's message.
        const std::string what = e.what_without_backtrace();
        if (what.find(", but received") == std::string::npos) {
          throw;
        }
        SINEW_THROW(InvalidArgument, "layer '", names[i].key(), "' cannot take ", describe(a),
                    " as its input (a layer takes at::Tensor when one tensor reaches it and "
                    "std::vector<at::Tensor> when several do): ",
                    what);
      }
    };
    torch::nn::AnyValue out = call();
    if (auto* t = out.try_get<at::Tensor>()) {
      a = pipeline::Activation(std::move(*t));
    } else if (auto* list = out.try_get<std::vector<at::Tensor>>()) {
      a = pipeline::Activation::ofList(std::move(*list));
    } else {
      SINEW_THROW(InvalidArgument, "layer '", names[i].key(), "' returns a ",
                  c10::demangle(out.type_info().name()),
                  "; a layer returns at::Tensor or std::vector<at::Tensor>");
    }
  }
  return a;
}

}  // namespace runtime
}  // namespace sinew
