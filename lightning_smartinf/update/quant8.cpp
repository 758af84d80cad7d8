// Block-wise 8-bit optimizer state (update/quant8.py): one pass per block, on ATen's intra-op threads
// (torch.set_num_threads governs them, as it does torch's own kernels; built with OpenMP, as torch is).
//
// quantize/dequantize: the Python reference's arithmetic in the same fp32 operations: y = value / absmax, then the
// nearer of the two map values around y (the lower one on a tie); dequantized = map[code] * absmax.
//
// adam8/sgd8/adagrad8: the host update with 8-bit state, fused: each block's state is widened, stepped and
// quantized again while it is in cache. The optimizer math is fpga_kernels/optimizers.cl's, operation for
// operation (its scalars come from update/arguments.py as the device's do), so the host and SmartUpdate write the
// same bytes. Built without fast-math and without contraction into FMAs, so results are identical.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 2048;

// The array loops are built for AVX-512, AVX2 and the baseline, the widest the CPU runs picked when the library
// loads (so one build serves any x86 CPU). Vector division and square root round as the scalar ones do.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDE
#endif

WIDE void widen_block(const uint8_t* codes, const float* table, float scale, int64_t len, float* out) {
    for (int64_t i = 0; i < len; ++i) out[i] = table[codes[i]] * scale;
}

// y[i] = values[i] / divisor, clamped to [lowest, 1] (the codes come from y)
WIDE void scaled(const float* values, int64_t len, float divisor, float lowest, float* y) {
    for (int64_t i = 0; i < len; ++i) {
        const float q = values[i] / divisor;
        y[i] = std::min(std::max(q, lowest), 1.0f);
    }
}

// known[i] = direct[bucket of y[i]]: the code of y[i], or -1 where the bucket needs the comparison
WIDE void lookup(const float* y, int64_t len, const int16_t* direct, int32_t offset, int32_t shift, int32_t buckets,
                 int16_t* known) {
    for (int64_t i = 0; i < len; ++i) {
        int32_t bits;
        std::memcpy(&bits, &y[i], sizeof(bits));
        int32_t bucket = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> shift) + offset;
        bucket = std::min(std::max(bucket, 0), buckets - 1);
        known[i] = direct[bucket];
    }
}

// the largest magnitude, NaN ignored (as fmax does on the device), in 16 lanes the compiler keeps in registers
WIDE float largest(const float* values, int64_t len) {
    float lanes[16] = {};
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        for (int j = 0; j < 16; ++j) {
            const float a = std::fabs(values[i + j]);
            lanes[j] = lanes[j] < a ? a : lanes[j];
        }
    }
    float absmax = 0.0f;
    for (int j = 0; j < 16; ++j) absmax = absmax < lanes[j] ? lanes[j] : absmax;
    for (; i < len; ++i) absmax = std::max(absmax, std::fabs(values[i]));
    return absmax;
}

inline int32_t sortable(float value) {
    int32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

// One map with its bucket tables: direct[bucket] is the code of every value in the bucket, or -1 where the nearest
// map value changes inside it; below[bucket] the largest map value at or below the bucket's first value.
struct Map {
    const float* table;
    const int16_t* direct;
    const int16_t* below;
    int64_t offset;
    int64_t buckets;
    int64_t shift;
    float lowest;

    Map(const torch::Tensor& map, const torch::Tensor& direct_codes, const torch::Tensor& below_codes, int64_t off,
        int64_t bucket_shift, bool is_signed)
        : table(map.data_ptr<float>()), direct(direct_codes.data_ptr<int16_t>()),
          below(below_codes.data_ptr<int16_t>()), offset(off), buckets(below_codes.numel()), shift(bucket_shift),
          lowest(is_signed ? -1.0f : 0.0f) {}

    // y in [lowest, 1], in a bucket whose code the comparison decides
    uint8_t compare(float y) const {
        int64_t bucket = static_cast<int64_t>(sortable(y) >> shift) + offset;
        bucket = std::min(std::max(bucket, int64_t{0}), buckets - 1);
        int64_t lo = below[bucket];
        if (lo < 255 && table[lo + 1] <= y) ++lo;
        const int64_t hi = std::min(lo + 1, int64_t{255});
        return static_cast<uint8_t>((y - table[lo]) <= (table[hi] - y) ? lo : hi);
    }

    // values[0, len) into codes, returning the block's absmax
    float quantize(const float* values, int64_t len, uint8_t* codes) const {
        const float absmax = largest(values, len);
        float y[kBlock];
        int16_t known[kBlock];
        scaled(values, len, absmax > 0.0f ? absmax : 1.0f, lowest, y);
        lookup(y, len, direct, int32_t(offset), int32_t(shift), int32_t(buckets), known);
        for (int64_t i = 0; i < len; ++i) codes[i] = known[i] >= 0 ? uint8_t(known[i]) : compare(y[i]);
        return absmax;
    }

    void widen(const uint8_t* codes, float scale, int64_t len, float* out) const {
        for (int64_t i = 0; i < len; ++i) out[i] = table[codes[i]] * scale;
    }
};

// A quantized state tensor: its codes and one absmax per block.
struct State {
    uint8_t* codes;
    float* scales;
    Map map;
    float init;
};

State state_of(torch::Tensor codes, torch::Tensor scales, const torch::Tensor& map, const torch::Tensor& direct,
               const torch::Tensor& below, int64_t offset, int64_t shift, bool is_signed, double init) {
    return State{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), Map(map, direct, below, offset, shift, is_signed),
                 static_cast<float>(init)};
}

void quantize(const torch::Tensor& values, const torch::Tensor& table, const torch::Tensor& direct,
              const torch::Tensor& below, int64_t offset, int64_t shift, bool is_signed, torch::Tensor codes,
              torch::Tensor scales) {
    const int64_t n = values.numel();
    const float* v = values.data_ptr<float>();
    const Map map(table, direct, below, offset, shift, is_signed);
    uint8_t* c = codes.data_ptr<uint8_t>();
    float* s = scales.data_ptr<float>();
    at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
            const int64_t start = b * kBlock;
            s[b] = map.quantize(v + start, std::min(n - start, kBlock), c + start);
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
    at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
            const int64_t start = b * kBlock;
            widen_block(c + start, t, s[b], std::min(n - start, kBlock), o + start);
        }
    });
}

// fpga_kernels/optimizers.cl's ADAM_MATH, SGD_MATH and ADAGRAD_MATH over arrays, operation for operation; the
// gradient arrives unscaled and clipped (StepContext.prepare).
struct AdamScalars {
    float beta1_weight, beta2, one_minus_beta2, eps, weight_decay, decay, step_size, bc2_sqrt;
    bool decoupled;
};

WIDE void adam_math(float* p, const float* grad, float* m, float* v, int64_t len, const AdamScalars& c) {
    for (int64_t i = 0; i < len; ++i) {
        float g = grad[i];
        if (c.decoupled) {
            if (c.weight_decay != 0.0f) p[i] = p[i] * c.decay;
        } else if (c.weight_decay != 0.0f) {
            g = g + c.weight_decay * p[i];
        }
        m[i] = m[i] + c.beta1_weight * (g - m[i]);
        v[i] = v[i] * c.beta2;
        v[i] = v[i] + c.one_minus_beta2 * g * g;
        p[i] = p[i] + (-c.step_size) * m[i] / (std::sqrt(v[i]) / c.bc2_sqrt + c.eps);
    }
}

struct SgdScalars {
    float lr, momentum, dampening_weight, weight_decay;
    bool nesterov, first_step;
};

WIDE void sgd_math(float* p, const float* grad, float* buf, int64_t len, const SgdScalars& c) {
    for (int64_t i = 0; i < len; ++i) {
        float d_p = grad[i];
        if (c.weight_decay != 0.0f) d_p = d_p + c.weight_decay * p[i];
        if (c.momentum != 0.0f) {
            buf[i] = c.first_step ? d_p : buf[i] * c.momentum + c.dampening_weight * d_p;
            d_p = c.nesterov ? d_p + c.momentum * buf[i] : buf[i];
        }
        p[i] = p[i] + (-c.lr) * d_p;
    }
}

struct AdagradScalars {
    float clr, weight_decay, eps;
};

WIDE void adagrad_math(float* p, const float* grad, float* sum, int64_t len, const AdagradScalars& c) {
    for (int64_t i = 0; i < len; ++i) {
        float g = grad[i];
        if (c.weight_decay != 0.0f) g = g + c.weight_decay * p[i];
        sum[i] = sum[i] + g * g;
        p[i] = p[i] + (-c.clr) * g / (std::sqrt(sum[i]) + c.eps);
    }
}

// Each block of the subgroup: its K state tensors widened (or at their initial value on the first step), the
// optimizer's math over the block (math(p, g, wide, len)), the state quantized back.
template <int K, typename Math>
void step_blocks(torch::Tensor master, const torch::Tensor& grad, State (&states)[K], bool first_step, Math math) {
    const int64_t n = master.numel();
    float* p = master.data_ptr<float>();
    const float* g = grad.data_ptr<float>();
    at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t first, int64_t last) {
        float wide[K][kBlock];
        for (int64_t b = first; b < last; ++b) {
            const int64_t start = b * kBlock;
            const int64_t len = std::min(n - start, kBlock);
            for (int k = 0; k < K; ++k) {
                if (first_step) {
                    std::fill(wide[k], wide[k] + len, states[k].init);
                } else {
                    widen_block(states[k].codes + start, states[k].map.table, states[k].scales[b], len, wide[k]);
                }
            }
            math(p + start, g + start, wide, len);
            for (int k = 0; k < K; ++k) {
                states[k].scales[b] = states[k].map.quantize(wide[k], len, states[k].codes + start);
            }
        }
    });
}

void adam8(torch::Tensor master, const torch::Tensor& grad, torch::Tensor m_codes, torch::Tensor m_scales,
           torch::Tensor v_codes, torch::Tensor v_scales, const torch::Tensor& signed_map,
           const torch::Tensor& signed_direct, const torch::Tensor& signed_below, int64_t signed_offset,
           const torch::Tensor& unsigned_map, const torch::Tensor& unsigned_direct,
           const torch::Tensor& unsigned_below, int64_t unsigned_offset, int64_t shift, bool first_step,
           double beta1_weight, double beta2, double one_minus_beta2, double eps, double weight_decay,
           bool decoupled, double decay, double step_size, double bc2_sqrt) {
    State states[2] = {
        state_of(m_codes, m_scales, signed_map, signed_direct, signed_below, signed_offset, shift, true, 0.0),
        state_of(v_codes, v_scales, unsigned_map, unsigned_direct, unsigned_below, unsigned_offset, shift, false, 0.0),
    };
    const AdamScalars c{float(beta1_weight), float(beta2), float(one_minus_beta2), float(eps), float(weight_decay),
                        float(decay), float(step_size), float(bc2_sqrt), decoupled};
    step_blocks<2>(master, grad, states, first_step, [&](float* p, const float* g, float (*wide)[kBlock], int64_t len) {
        adam_math(p, g, wide[0], wide[1], len, c);
    });
}

// SGD with momentum (without it there is no state to keep).
void sgd8(torch::Tensor master, const torch::Tensor& grad, torch::Tensor codes, torch::Tensor scales,
          const torch::Tensor& map, const torch::Tensor& direct, const torch::Tensor& below, int64_t offset,
          int64_t shift, bool first_step, double lr, double momentum, double dampening_weight, double weight_decay,
          bool nesterov) {
    State states[1] = {state_of(codes, scales, map, direct, below, offset, shift, true, 0.0)};
    const SgdScalars c{float(lr), float(momentum), float(dampening_weight), float(weight_decay), nesterov, first_step};
    step_blocks<1>(master, grad, states, first_step, [&](float* p, const float* g, float (*wide)[kBlock], int64_t len) {
        sgd_math(p, g, wide[0], len, c);
    });
}

void adagrad8(torch::Tensor master, const torch::Tensor& grad, torch::Tensor codes, torch::Tensor scales,
              const torch::Tensor& map, const torch::Tensor& direct, const torch::Tensor& below, int64_t offset,
              int64_t shift, bool first_step, double init, double clr, double weight_decay, double eps) {
    State states[1] = {state_of(codes, scales, map, direct, below, offset, shift, false, init)};
    const AdagradScalars c{float(clr), float(weight_decay), float(eps)};
    step_blocks<1>(master, grad, states, first_step, [&](float* p, const float* g, float (*wide)[kBlock], int64_t len) {
        adagrad_math(p, g, wide[0], len, c);
    });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("quantize", &quantize, "block-wise 8-bit quantization into codes and absmax values");
    m.def("dequantize", &dequantize, "codes and absmax values back to fp32");
    m.def("adam8", &adam8, "Adam/AdamW on a subgroup whose moments are 8-bit, fused");
    m.def("sgd8", &sgd8, "SGD with momentum on a subgroup whose buffer is 8-bit, fused");
    m.def("adagrad8", &adagrad8, "Adagrad on a subgroup whose sum is 8-bit, fused");
}
