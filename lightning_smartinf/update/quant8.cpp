// Block-wise 8-bit quantization of optimizer state (update/quant8.py): one pass per block, on ATen's intra-op
// threads (torch.set_num_threads governs them, as it does torch's own kernels). The arithmetic is the Python
// reference's, in the same fp32 operations: y = value / absmax, then the nearer of the two map values around y
// (the lower one on a tie); dequantized = map[code] * absmax. Built without fast-math, so results are identical.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 2048;

inline int32_t sortable(float value) {
    int32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

// direct[bucket]: the code of every value in the bucket, or -1 where the nearest map value changes inside it; then
// below[bucket] (the largest map value at or below the bucket's first value) and the comparison decide.
void quantize(const torch::Tensor& values, const torch::Tensor& table, const torch::Tensor& direct,
              const torch::Tensor& below, int64_t offset, int64_t shift, bool is_signed, torch::Tensor codes,
              torch::Tensor scales) {
    const int64_t n = values.numel();
    const float* v = values.data_ptr<float>();
    const float* t = table.data_ptr<float>();
    const int16_t* code_of = direct.data_ptr<int16_t>();
    const int16_t* low_of = below.data_ptr<int16_t>();
    const int64_t buckets = below.numel();
    uint8_t* c = codes.data_ptr<uint8_t>();
    float* s = scales.data_ptr<float>();
    const float floor_value = is_signed ? -1.0f : 0.0f;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
            const int64_t start = b * kBlock;
            const int64_t end = std::min(n, start + kBlock);
            float absmax = 0.0f;
            for (int64_t i = start; i < end; ++i) absmax = std::max(absmax, std::fabs(v[i]));
            s[b] = absmax;
            const float divisor = absmax > 0.0f ? absmax : 1.0f;
            for (int64_t i = start; i < end; ++i) {
                float y = v[i] / divisor;
                y = std::min(std::max(y, floor_value), 1.0f);
                int64_t bucket = (static_cast<int64_t>(sortable(y) >> shift)) + offset;
                bucket = std::min(std::max(bucket, int64_t{0}), buckets - 1);
                const int16_t known = code_of[bucket];
                if (known >= 0) {
                    c[i] = static_cast<uint8_t>(known);
                    continue;
                }
                int64_t lo = low_of[bucket];
                if (lo < 255 && t[lo + 1] <= y) ++lo;
                const int64_t hi = std::min(lo + 1, int64_t{255});
                c[i] = static_cast<uint8_t>((y - t[lo]) <= (t[hi] - y) ? lo : hi);
            }
        }
    });
}

void dequantize(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& table,
                torch::Tensor out) {
    const int64_t n = out.numel();
    const uint8_t* c = codes.data_ptr<uint8_t>();
    const float* s = scales.data_ptr<float>();
    const float* t = table.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
            const int64_t start = b * kBlock;
            const int64_t end = std::min(n, start + kBlock);
            const float scale = s[b];
            for (int64_t i = start; i < end; ++i) o[i] = t[c[i]] * scale;
        }
    });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("quantize", &quantize, "block-wise 8-bit quantization into codes and absmax values");
    m.def("dequantize", &dequantize, "codes and absmax values back to fp32");
}
