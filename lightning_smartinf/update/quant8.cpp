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
#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 2048;

// The array loops are built for AVX-512, AVX2 and the baseline, the widest the CPU runs picked when the library
// loads (so one build serves any x86 CPU). Vector division and square root round as the scalar ones do.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDE
#endif

void widen_scalar(const uint8_t* codes, const float* table, float scale, int64_t len, float* out) {
    for (int64_t i = 0; i < len; ++i) out[i] = table[codes[i]] * scale;
}

// The same with vector gathers from the 256-entry map (the compiler does not emit gathers for the loop above).
#if defined(__x86_64__) && defined(__GNUC__)
#define SIMD_GATHER 1
__attribute__((target("avx512f"))) void widen_avx512(const uint8_t* codes, const float* table, float scale,
                                                     int64_t len, float* out) {
    const __m512 factor = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(index, table, 4), factor));
    }
    widen_scalar(codes + i, table, scale, len - i, out + i);
}

__attribute__((target("avx2"))) void widen_avx2(const uint8_t* codes, const float* table, float scale, int64_t len,
                                                float* out) {
    const __m256 factor = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(table, index, 4), factor));
    }
    widen_scalar(codes + i, table, scale, len - i, out + i);
}
#endif

// The widest gathers the CPU runs, picked once: "avx512", "avx2" or "baseline". The environment variable
// LIGHTNING_SMARTINF_QUANT8_ISA caps it (to test and compare the paths; the results are the same byte for byte).
const char* pick_isa() {
    const char* cap = std::getenv("LIGHTNING_SMARTINF_QUANT8_ISA");
    const std::string most = cap == nullptr || *cap == '\0' ? "avx512" : cap;  // update/quant8.py checks it
#ifdef SIMD_GATHER
    __builtin_cpu_init();
    if (most == "avx512" && __builtin_cpu_supports("avx512f")) return "avx512";
    if ((most == "avx512" || most == "avx2") && __builtin_cpu_supports("avx2")) return "avx2";
#endif
    return "baseline";
}

const std::string isa = pick_isa();

// GATHERS(name): the build of name_avx512, name_avx2 and name_scalar for the instruction set picked
template <typename F>
F by_isa(F avx512, F avx2, F baseline) {
    return isa == "avx512" ? avx512 : isa == "avx2" ? avx2 : baseline;
}

#ifdef SIMD_GATHER
#define GATHERS(name) by_isa(name##_avx512, name##_avx2, name##_scalar)
#else
#define GATHERS(name) name##_scalar
#endif

const auto widen_block = GATHERS(widen);

// y[i] = values[i] / divisor, clamped to [lowest, 1] (the codes come from y)
WIDE void scaled(const float* values, int64_t len, float divisor, float lowest, float* y) {
    for (int64_t i = 0; i < len; ++i) {
        const float q = values[i] / divisor;
        y[i] = std::min(std::max(q, lowest), 1.0f);
    }
}

// The codes of y[0, len) from the bucket table: codes[i] = direct[bucket of y[i]], and where that is -1 (the bucket
// needs the comparison) the bit i of the returned mask set, for the caller to decide. Blocks of at most 64 elements.
inline int32_t sortable(float value) {
    int32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

inline int32_t bucket_of(float y, int32_t offset, int32_t shift, int32_t buckets) {
    return std::min(std::max((sortable(y) >> shift) + offset, 0), buckets - 1);
}

uint64_t lookup_scalar(const float* y, int64_t len, const int16_t* direct, int32_t offset, int32_t shift,
                       int32_t buckets, uint8_t* codes) {
    uint64_t pending = 0;
    for (int64_t i = 0; i < len; ++i) {
        const int16_t known = direct[bucket_of(y[i], offset, shift, buckets)];
        codes[i] = uint8_t(known);
        if (known < 0) pending |= uint64_t{1} << i;
    }
    return pending;
}

// The same with vector gathers: the table is padded by one entry, so the 32 bits read at any bucket stay inside it
// (buckets() in update/quant8.py); the entry is their low 16 bits (x86 is little-endian).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) uint64_t lookup_avx512(const float* y, int64_t len, const int16_t* direct,
                                                          int32_t offset, int32_t shift, int32_t buckets,
                                                          uint8_t* codes) {
    const __m512i low31 = _mm512_set1_epi32(0x7FFFFFFF), first = _mm512_set1_epi32(offset);
    const __m512i last = _mm512_set1_epi32(buckets - 1), zero = _mm512_setzero_si512();
    const __m128i count = _mm_cvtsi32_si128(shift);
    uint64_t pending = 0;
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512i bits = _mm512_loadu_si512(y + i);
        const __m512i order = _mm512_xor_si512(bits, _mm512_and_si512(_mm512_srai_epi32(bits, 31), low31));
        __m512i bucket = _mm512_add_epi32(_mm512_sra_epi32(order, count), first);
        bucket = _mm512_min_epi32(_mm512_max_epi32(bucket, zero), last);
        const __m512i word = _mm512_i32gather_epi32(bucket, static_cast<const void*>(direct), 2);
        const __m512i known = _mm512_srai_epi32(_mm512_slli_epi32(word, 16), 16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(known));
        pending |= uint64_t(_mm512_cmplt_epi32_mask(known, zero)) << i;
    }
    return pending | (lookup_scalar(y + i, len - i, direct, offset, shift, buckets, codes + i) << i);
}

__attribute__((target("avx2"))) uint64_t lookup_avx2(const float* y, int64_t len, const int16_t* direct,
                                                      int32_t offset, int32_t shift, int32_t buckets, uint8_t* codes) {
    const __m256i low31 = _mm256_set1_epi32(0x7FFFFFFF), first = _mm256_set1_epi32(offset);
    const __m256i last = _mm256_set1_epi32(buckets - 1), zero = _mm256_setzero_si256();
    const __m128i count = _mm_cvtsi32_si128(shift);
    const int* table = reinterpret_cast<const int*>(direct);
    uint64_t pending = 0;
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + i));
        const __m256i order = _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), low31));
        __m256i bucket = _mm256_add_epi32(_mm256_sra_epi32(order, count), first);
        bucket = _mm256_min_epi32(_mm256_max_epi32(bucket, zero), last);
        const __m256i word = _mm256_i32gather_epi32(table, bucket, 2);
        const __m256i known = _mm256_srai_epi32(_mm256_slli_epi32(word, 16), 16);
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(known), _mm256_extracti128_si256(known, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(words, words));
        pending |= uint64_t(_mm256_movemask_ps(_mm256_castsi256_ps(known))) << i;
    }
    return pending | (lookup_scalar(y + i, len - i, direct, offset, shift, buckets, codes + i) << i);
}
#endif

const auto lookup = GATHERS(lookup);

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
        int64_t lo = below[bucket_of(y, int32_t(offset), int32_t(shift), int32_t(buckets))];
        if (lo < 255 && table[lo + 1] <= y) ++lo;
        const int64_t hi = std::min(lo + 1, int64_t{255});
        return static_cast<uint8_t>((y - table[lo]) <= (table[hi] - y) ? lo : hi);
    }

    // values[0, len) into codes, returning the block's absmax
    float quantize(const float* values, int64_t len, uint8_t* codes) const {
        const float absmax = largest(values, len);
        float y[kBlock];
        scaled(values, len, absmax > 0.0f ? absmax : 1.0f, lowest, y);
        for (int64_t start = 0; start < len; start += 64) {
            const int64_t part = std::min(len - start, int64_t{64});
            uint64_t pending = lookup(y + start, part, direct, int32_t(offset), int32_t(shift), int32_t(buckets),
                                      codes + start);
            for (; pending != 0; pending &= pending - 1) {
                const int64_t i = start + __builtin_ctzll(pending);
                codes[i] = compare(y[i]);
            }
        }
        return absmax;
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

WIDE void adam_math(float* p, const float* grad, float* m, float* v, int64_t len, const AdamScalars& scalars) {
    const AdamScalars c = scalars;  // a copy the stores below cannot alias, so the loop vectorizes
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

WIDE void sgd_math(float* p, const float* grad, float* buf, int64_t len, const SgdScalars& scalars) {
    const SgdScalars c = scalars;
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

WIDE void adagrad_math(float* p, const float* grad, float* sum, int64_t len, const AdagradScalars& scalars) {
    const AdagradScalars c = scalars;
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
    m.def("isa", [] { return isa; }, "the gathers' instruction set: avx512, avx2 or baseline");
}
