// Every decoder layer of a small decode step in one call: the layers' Python, one module
// call and a dozen tensor ops each, costs a few milliseconds a step, which at one sequence
// is a fifth of the step. Here the same kernels run in the same order on the same tensors
// as worker/model.py's DecoderLayer (RMSNorm, the few-row linear, rope with the KV write,
// paged decode attention, SiLU-and-mul), so the result is the same to the bit; only the
// calls between them leave Python. worker/model.py decides when it applies.
//
// Under `--quantization int8` each linear is Int8Linear's call instead (worker/quant.py):
// the rows quantized (quantize_rows), then the AVX2, AVX-512 or AMX int8 matmul on the packed weight
// with its channel scales; `int8_path` says which (0: the bfloat16 few-row linear).
#include <ATen/ATen.h>
#include <torch/types.h>  // bindings are in paged_decode_cpu.cpp

#include <tuple>
#include <vector>

std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                    torch::Tensor weight, double eps);
torch::Tensor rope_write_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                            torch::Tensor positions, torch::Tensor cos_sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots);
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           bool generic, c10::optional<torch::Tensor> skip, double softcap);
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor silu_and_mul(torch::Tensor x);
bool silu_and_mul_supported();
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x);
at::Tensor avx2_int8_matmul(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wp,
                            const at::Tensor& ws, const c10::optional<at::Tensor>& bias,
                            at::ScalarType dtype);
at::Tensor amx_int8_matmul(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wb,
                           const at::Tensor& ws, const c10::optional<at::Tensor>& bias,
                           at::ScalarType dtype);
at::Tensor avx512_int8_matmul(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wp,
                              const at::Tensor& ws, const c10::optional<at::Tensor>& bias,
                              at::ScalarType dtype);

enum Int8Path : int64_t { kNoInt8 = 0, kAvx2Int8 = 1, kAmxInt8 = 2, kAvx512Int8 = 3 };

static constexpr int64_t kWeights = 6;  // per layer: in norm, qkv, o, post norm, gate_up, down
static constexpr int64_t kBiases = 4;   // per layer: qkv, o, gate_up, down (empty: none)

// h [rows, hidden] (the embeddings) through every layer; returns {h, residual} as the
// Python loop leaves them. `weights` and `biases` hold kWeights and kBiases tensors a layer;
// under int8, the linears' weights are the packed int8 ones, and `scales` holds their
// channel scales (kBiases a layer, in the biases' order), else it is empty.
std::vector<torch::Tensor> decode_layers(torch::Tensor h, torch::Tensor positions,
                                         torch::Tensor cos_sin, torch::Tensor slots,
                                         torch::Tensor block_tables, torch::Tensor context_lens,
                                         std::vector<torch::Tensor> k_caches,
                                         std::vector<torch::Tensor> v_caches,
                                         std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> biases,
                                         std::vector<torch::Tensor> scales, int64_t int8_path,
                                         int64_t num_heads, int64_t num_kv_heads,
                                         int64_t head_dim, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(weights.size()) == layers * kWeights &&
                  static_cast<int64_t>(biases.size()) == layers * kBiases,
              "decode_layers: ", kWeights, " weights, ", kBiases, " biases and 2 caches a layer");
  TORCH_CHECK(int8_path == kNoInt8 || int8_path == kAvx2Int8 || int8_path == kAmxInt8 ||
                  int8_path == kAvx512Int8,
              "decode_layers: int8_path is 0, 1, 2 or 3");
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == (int8_path == kNoInt8 ? 0 : layers * kBiases),
              "decode_layers: ", kBiases, " scales a layer under int8, none otherwise");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode_layers: h is [rows, hidden]");
  const int64_t n = h.size(0), qs = num_heads * head_dim, kvs = num_kv_heads * head_dim;
  // As dispatch's silu_and_mul chooses: the compiled one takes bfloat16 only (a float32
  // model's decode comes here under int8).
  const bool ext_silu = silu_and_mul_supported() && h.scalar_type() == at::kBFloat16;
  auto bias = [&](int64_t i) -> c10::optional<torch::Tensor> {
    const torch::Tensor& b = biases[i];
    return b.numel() ? c10::optional<torch::Tensor>(b) : c10::nullopt;
  };
  // Linear j (0 qkv, 1 o, 2 gate_up, 3 down) of layer l, as PackedLinear.matmul runs it.
  auto linear = [&](const torch::Tensor& x, int64_t l, int64_t j, const torch::Tensor& w) {
    const int64_t i = l * kBiases + j;
    if (int8_path == kNoInt8) return small_linear(x, w, bias(i));
    auto [q, s] = quantize_rows(x);
    if (int8_path == kAvx512Int8) return avx512_int8_matmul(q, s, w, scales[i], bias(i), x.scalar_type());
    return int8_path == kAvx2Int8 ? avx2_int8_matmul(q, s, w, scales[i], bias(i), x.scalar_type())
                                  : amx_int8_matmul(q, s, w, scales[i], bias(i), x.scalar_type());
  };
  torch::Tensor residual;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + l * kWeights;
    torch::Tensor x;
    if (l == 0) {  // DecoderLayer.forward with no residual yet: it is the input
      residual = h;
      x = rms_norm(h, c10::nullopt, w[0], eps)[0];
    } else {
      auto r = rms_norm(h, residual, w[0], eps);
      x = r[0];
      residual = r[1];
    }
    // Attention.forward: q, k, v are views of the qkv output, as its split makes them.
    const torch::Tensor qkv = linear(x, l, 0, w[1]);
    const torch::Tensor q = qkv.narrow(1, 0, qs).view({n, num_heads, head_dim});
    const torch::Tensor k = qkv.narrow(1, qs, kvs).view({n, num_kv_heads, head_dim});
    const torch::Tensor v = qkv.narrow(1, qs + kvs, kvs).view({n, num_kv_heads, head_dim});
    const torch::Tensor qr =
        rope_write_kv(q, k, v, positions, cos_sin, k_caches[l], v_caches[l], slots);
    const torch::Tensor att =
        paged_decode(qr, k_caches[l], v_caches[l], block_tables, context_lens, scale, false,
                     c10::nullopt, 0.0);  // no windows, no soft-capping: FusedDecode.build
    const torch::Tensor o = linear(att.view({n, qs}), l, 1, w[2]);
    auto r = rms_norm(o, residual, w[3], eps);
    residual = r[1];
    // MLP.forward, with dispatch's silu_and_mul: the compiled one (AVX512-BF16 or AVX2), else
    // the reference's ops (silu of the gate half, times the up half).
    const torch::Tensor gu = linear(r[0], l, 2, w[4]);
    const int64_t inter = gu.size(1) / 2;
    const torch::Tensor act =
        ext_silu ? silu_and_mul(gu) : at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
    h = linear(act, l, 3, w[5]);
  }
  return {h, residual};
}
