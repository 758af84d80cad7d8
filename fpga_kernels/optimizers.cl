// Optimizer updates for near-storage accelerators (SmartUpdate).
//
// Each work-item updates VEC (8) consecutive elements with vector loads and stores; the last one finishes a
// partial vector element by element, so every access stays inside the subgroup's n elements. The same source
// builds at run time with any OpenCL driver (PoCL on a CPU here) and offline with Xilinx v++ for a
// SmartSSD/Alveo FPGA (see README.md). Build-time defines:
//   GRAD_FORMAT   0 = fp32, 1 = bf16, 2 = fp16     (the gradient as it arrives from the trainer)
//   PARAM_FORMAT  0 = fp32, 1 = bf16, 2 = fp16     (the parameter copy that goes back to the trainer)
// The arithmetic mirrors torch.optim's single-tensor implementations step by step, without contraction into
// FMAs, so results match the host update to float rounding. Each optimizer's math is written once (a macro over
// the element type) and used by the vector body and the scalar tail.

#pragma OPENCL FP_CONTRACT OFF

#define VEC 8

#ifndef GRAD_FORMAT
#define GRAD_FORMAT 0
#endif
#ifndef PARAM_FORMAT
#define PARAM_FORMAT 0
#endif

#if GRAD_FORMAT == 0
typedef float grad_t;
#else
typedef ushort grad_t;
#endif
#if PARAM_FORMAT == 0
typedef float param_t;
#else
typedef ushort param_t;
#endif

// ---- formats ------------------------------------------------------------------------------------------------------

inline float bf16_to_f32(ushort bits) { return as_float(((uint)bits) << 16); }
inline float8 bf16_to_f32_8(ushort8 bits) { return as_float8(convert_uint8(bits) << 16); }

// Round to nearest even, NaN stays NaN (torch's float -> bfloat16 conversion).
inline ushort f32_to_bf16(float value) {
    uint bits = as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (ushort)((bits >> 16) | 0x40u);
    return (ushort)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline ushort8 f32_to_bf16_8(float8 value) {
    uint8 bits = as_uint8(value);
    uint8 rounded = (bits + (uint8)(0x7fffu) + ((bits >> 16) & (uint8)(1u))) >> 16;
    uint8 quiet_nan = (bits >> 16) | (uint8)(0x40u);
    return convert_ushort8(select(rounded, quiet_nan, (bits & (uint8)(0x7fffffffu)) > (uint8)(0x7f800000u)));
}

inline float load_grad(__global const grad_t* grad, uint j) {
#if GRAD_FORMAT == 0
    return grad[j];
#elif GRAD_FORMAT == 1
    return bf16_to_f32(grad[j]);
#else
    return vload_half(j, (__global const half*)grad);
#endif
}
inline float8 load_grad8(__global const grad_t* grad, uint i) {
#if GRAD_FORMAT == 0
    return vload8(i, grad);
#elif GRAD_FORMAT == 1
    return bf16_to_f32_8(vload8(i, grad));
#else
    return vload_half8(i, (__global const half*)grad);
#endif
}

inline void store_param(__global param_t* out, uint j, float value) {
#if PARAM_FORMAT == 0
    out[j] = value;
#elif PARAM_FORMAT == 1
    out[j] = f32_to_bf16(value);
#else
    vstore_half_rte(value, j, (__global half*)out);
#endif
}
inline void store_param8(__global param_t* out, uint i, float8 value) {
#if PARAM_FORMAT == 0
    vstore8(value, i, out);
#elif PARAM_FORMAT == 1
    vstore8(f32_to_bf16_8(value), i, out);
#else
    vstore_half8_rte(value, i, (__global half*)out);
#endif
}

// Unscale (1/loss_scale) then clip, each only when it is not 1, as the host does.
#define PREPARE_GRAD(g)                        \
    if (inv_scale != 1.0f) g = g * inv_scale; \
    if (clip_coef != 1.0f) g = g * clip_coef;

// ---- Adam / AdamW ---------------------------------------------------------------------------------------------------
// torch.optim.Adam / AdamW (amsgrad=False). step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t) and
// decay = 1 - lr * weight_decay are computed on the host in double precision, as torch does.
#define ADAM_MATH(p, g, m, v)                                    \
    if (decoupled) {                                             \
        if (weight_decay != 0.0f) p = p * decay;                 \
    } else if (weight_decay != 0.0f) {                           \
        g = g + weight_decay * p;                                \
    }                                                            \
    m = m + beta1_weight * (g - m); /* lerp(m, g, 1 - beta1) */  \
    v = v * beta2;                                               \
    v = v + one_minus_beta2 * g * g;                             \
    p = p + (-step_size) * m / (sqrt(v) / bc2_sqrt + eps);

__kernel void adam(__global float* master, __global float* exp_avg, __global float* exp_avg_sq,
                   __global const grad_t* grad, __global param_t* param_out, const uint n,
                   const float inv_scale, const float clip_coef, const float beta1_weight, const float beta2,
                   const float one_minus_beta2, const float eps, const float weight_decay, const int decoupled,
                   const float decay, const float step_size, const float bc2_sqrt) {
    const uint i = get_global_id(0);
    if (i * VEC + VEC <= n) {
        float8 p = vload8(i, master), g = load_grad8(grad, i), m = vload8(i, exp_avg), v = vload8(i, exp_avg_sq);
        PREPARE_GRAD(g)
        ADAM_MATH(p, g, m, v)
        vstore8(p, i, master);
        vstore8(m, i, exp_avg);
        vstore8(v, i, exp_avg_sq);
        store_param8(param_out, i, p);
        return;
    }
    for (uint j = i * VEC; j < n; ++j) {
        float p = master[j], g = load_grad(grad, j), m = exp_avg[j], v = exp_avg_sq[j];
        PREPARE_GRAD(g)
        ADAM_MATH(p, g, m, v)
        master[j] = p;
        exp_avg[j] = m;
        exp_avg_sq[j] = v;
        store_param(param_out, j, p);
    }
}

// ---- SGD with momentum ----------------------------------------------------------------------------------------------
// torch.optim.SGD (dampening, nesterov, weight decay). On the first step the buffer starts as the gradient itself.
#define SGD_MATH(p, d_p, buf)                                                      \
    if (weight_decay != 0.0f) d_p = d_p + weight_decay * p;                        \
    if (momentum != 0.0f) {                                                        \
        buf = first_step ? d_p : buf * momentum + dampening_weight * d_p;          \
        d_p = nesterov ? d_p + momentum * buf : buf;                               \
    }                                                                              \
    p = p + (-lr) * d_p;

__kernel void sgd(__global float* master, __global float* momentum_buffer, __global const grad_t* grad,
                  __global param_t* param_out, const uint n, const float inv_scale, const float clip_coef,
                  const float lr, const float momentum, const float dampening_weight, const float weight_decay,
                  const int nesterov, const int first_step) {
    const uint i = get_global_id(0);
    if (i * VEC + VEC <= n) {
        float8 p = vload8(i, master), d_p = load_grad8(grad, i);
        float8 buf = momentum != 0.0f && !first_step ? vload8(i, momentum_buffer) : (float8)(0.0f);
        PREPARE_GRAD(d_p)
        SGD_MATH(p, d_p, buf)
        if (momentum != 0.0f) vstore8(buf, i, momentum_buffer);
        vstore8(p, i, master);
        store_param8(param_out, i, p);
        return;
    }
    for (uint j = i * VEC; j < n; ++j) {
        float p = master[j], d_p = load_grad(grad, j);
        float buf = momentum != 0.0f && !first_step ? momentum_buffer[j] : 0.0f;
        PREPARE_GRAD(d_p)
        SGD_MATH(p, d_p, buf)
        if (momentum != 0.0f) momentum_buffer[j] = buf;
        master[j] = p;
        store_param(param_out, j, p);
    }
}

// ---- Adagrad --------------------------------------------------------------------------------------------------------
// torch.optim.Adagrad. clr = lr / (1 + (t - 1) * lr_decay) is computed on the host.
#define ADAGRAD_MATH(p, g, s)                                \
    if (weight_decay != 0.0f) g = g + weight_decay * p;      \
    s = s + g * g;                                           \
    p = p + (-clr) * g / (sqrt(s) + eps);

__kernel void adagrad(__global float* master, __global float* state_sum, __global const grad_t* grad,
                      __global param_t* param_out, const uint n, const float inv_scale, const float clip_coef,
                      const float clr, const float weight_decay, const float eps) {
    const uint i = get_global_id(0);
    if (i * VEC + VEC <= n) {
        float8 p = vload8(i, master), g = load_grad8(grad, i), s = vload8(i, state_sum);
        PREPARE_GRAD(g)
        ADAGRAD_MATH(p, g, s)
        vstore8(p, i, master);
        vstore8(s, i, state_sum);
        store_param8(param_out, i, p);
        return;
    }
    for (uint j = i * VEC; j < n; ++j) {
        float p = master[j], g = load_grad(grad, j), s = state_sum[j];
        PREPARE_GRAD(g)
        ADAGRAD_MATH(p, g, s)
        master[j] = p;
        state_sum[j] = s;
        store_param(param_out, j, p);
    }
}
