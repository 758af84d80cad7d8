// Optimizer updates for near-storage accelerators (SmartUpdate).
//
// One work-item per element of a subgroup. The same source builds at run time with any OpenCL driver (PoCL on a
// CPU here) and offline with Xilinx v++ for a SmartSSD/Alveo FPGA (see README.md). Build-time defines:
//   GRAD_FORMAT   0 = fp32, 1 = bf16, 2 = fp16     (the gradient as it arrives from the trainer)
//   PARAM_FORMAT  0 = fp32, 1 = bf16, 2 = fp16     (the parameter copy that goes back to the trainer)
// The arithmetic mirrors torch.optim's single-tensor implementations step by step, without contraction into
// FMAs, so results match the host update to float rounding.

#pragma OPENCL FP_CONTRACT OFF

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

inline float bf16_to_f32(ushort bits) { return as_float(((uint)bits) << 16); }

// Round to nearest even, NaN stays NaN (torch's float -> bfloat16 conversion).
inline ushort f32_to_bf16(float value) {
    uint bits = as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (ushort)((bits >> 16) | 0x40u);
    return (ushort)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float load_grad(__global const grad_t* grad, uint i) {
#if GRAD_FORMAT == 0
    return grad[i];
#elif GRAD_FORMAT == 1
    return bf16_to_f32(grad[i]);
#else
    return vload_half(i, (__global const half*)grad);
#endif
}

inline void store_param(__global param_t* out, uint i, float value) {
#if PARAM_FORMAT == 0
    out[i] = value;
#elif PARAM_FORMAT == 1
    out[i] = f32_to_bf16(value);
#else
    vstore_half_rte(value, i, (__global half*)out);
#endif
}

// Unscale (1/loss_scale) and clip, in that order, each only when it is not 1 (as the host does).
inline float prepare_grad(__global const grad_t* grad, uint i, float inv_scale, float clip_coef) {
    float g = load_grad(grad, i);
    if (inv_scale != 1.0f) g = g * inv_scale;
    if (clip_coef != 1.0f) g = g * clip_coef;
    return g;
}

// torch.optim.Adam / AdamW (amsgrad=False). step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t) and
// decay = 1 - lr * weight_decay are computed on the host in double precision, as torch does.
__kernel void adam(__global float* master, __global float* exp_avg, __global float* exp_avg_sq,
                   __global const grad_t* grad, __global param_t* param_out, const uint n,
                   const float inv_scale, const float clip_coef, const float beta1_weight, const float beta2,
                   const float one_minus_beta2, const float eps, const float weight_decay, const int decoupled,
                   const float decay, const float step_size, const float bc2_sqrt) {
    const uint i = get_global_id(0);
    if (i >= n) return;
    float p = master[i];
    float g = prepare_grad(grad, i, inv_scale, clip_coef);
    if (decoupled) {
        if (weight_decay != 0.0f) p = p * decay;
    } else if (weight_decay != 0.0f) {
        g = g + weight_decay * p;
    }
    float m = exp_avg[i];
    m = m + beta1_weight * (g - m);  // lerp(m, g, 1 - beta1) for a weight below 0.5
    float v = exp_avg_sq[i] * beta2;
    v = v + one_minus_beta2 * g * g;
    const float denom = sqrt(v) / bc2_sqrt + eps;
    p = p + (-step_size) * m / denom;
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    store_param(param_out, i, p);
}

// torch.optim.SGD with momentum (dampening, nesterov, weight decay). On the first step the buffer starts as the
// gradient itself (first_step = 1), as torch's does.
__kernel void sgd(__global float* master, __global float* momentum_buffer, __global const grad_t* grad,
                  __global param_t* param_out, const uint n, const float inv_scale, const float clip_coef,
                  const float lr, const float momentum, const float dampening_weight, const float weight_decay,
                  const int nesterov, const int first_step) {
    const uint i = get_global_id(0);
    if (i >= n) return;
    float p = master[i];
    float d_p = prepare_grad(grad, i, inv_scale, clip_coef);
    if (weight_decay != 0.0f) d_p = d_p + weight_decay * p;
    if (momentum != 0.0f) {
        float buf = first_step ? d_p : momentum_buffer[i] * momentum + dampening_weight * d_p;
        momentum_buffer[i] = buf;
        d_p = nesterov ? d_p + momentum * buf : buf;
    }
    p = p + (-lr) * d_p;
    master[i] = p;
    store_param(param_out, i, p);
}

// torch.optim.Adagrad. clr = lr / (1 + (t - 1) * lr_decay) is computed on the host.
__kernel void adagrad(__global float* master, __global float* state_sum, __global const grad_t* grad,
                      __global param_t* param_out, const uint n, const float inv_scale, const float clip_coef,
                      const float clr, const float weight_decay, const float eps) {
    const uint i = get_global_id(0);
    if (i >= n) return;
    float p = master[i];
    float g = prepare_grad(grad, i, inv_scale, clip_coef);
    if (weight_decay != 0.0f) g = g + weight_decay * p;
    const float s = state_sum[i] + g * g;
    const float std_ = sqrt(s) + eps;
    p = p + (-clr) * g / std_;
    master[i] = p;
    state_sum[i] = s;
    store_param(param_out, i, p);
}
