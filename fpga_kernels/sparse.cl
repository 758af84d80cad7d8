// SmartComp decompression on the near-storage device: zero-fill the subgroup's gradient buffer, then scatter the
// received top-k values into it. The optimizer kernel (optimizers.cl) runs next on the dense fp32 gradient, so
// the dense gradient never crosses the host link.
//   VALUE_FORMAT  1 = bf16, 2 = fp16   (the 16-bit values on the wire; indices are int32)

#ifndef VALUE_FORMAT
#define VALUE_FORMAT 1
#endif

#pragma OPENCL FP_CONTRACT OFF

inline float load_value(__global const ushort* value, uint j) {
#if VALUE_FORMAT == 1
    return as_float(((uint)value[j]) << 16);
#else
    return vload_half(j, (__global const half*)value);
#endif
}

__kernel void zero_fill(__global float* grad, const uint n) {
    const uint i = get_global_id(0);
    if (i < n) grad[i] = 0.0f;
}

__kernel void scatter(__global float* grad, const uint n, __global const int* index,
                      __global const ushort* value, const uint nnz) {
    const uint j = get_global_id(0);
    if (j >= nnz) return;
    const int i = index[j];
    if (i < 0 || (uint)i >= n) return;  // a malformed index never writes outside the subgroup
    grad[i] = load_value(value, j);
}

// ---- catch-up Adam / AdamW (compression.catch_up) -------------------------------------------------------------------
// The device updates only the elements it receives. An element sent at optimizer step `step` last moved at
// `last_step` (or when compression started, `start`), so it missed T = step - max(last_step, start) steps; it
// arrives with the sum of its (unscaled, clipped) gradients over those steps and the sum of their squares. Adam's
// moments advance T steps at once with the wait's mean gradient g and mean square s (m = beta1^T m + (1 - beta1^T) g,
// v likewise), and the parameter moves T steps of the result. Decoupled weight decay, which every element takes every
// step, runs first over the whole subgroup (adam_decay); Adam's L2 term joins g (and s) at the current parameter.
// The arithmetic runs without FMA contraction (the pragma at the top), like optimizers.cl.

__kernel void adam_decay(__global float* master, __global float* param_out, const uint n, const float decay) {
    const uint i = get_global_id(0);
    if (i >= n) return;
    const float p = master[i] * decay;
    master[i] = p;
    param_out[i] = p;
}

__kernel void adam_catch_up(__global float* master, __global float* exp_avg, __global float* exp_avg_sq,
                            __global float* last_step, __global float* param_out, const uint n,
                            __global const int* index, __global const ushort* value, __global const ushort* square,
                            const uint nnz, const float beta1, const float beta2, const float eps,
                            const float l2, const float step, const float start, const float step_size,
                            const float bc2_sqrt) {
    const uint j = get_global_id(0);
    if (j >= nnz) return;
    const int i = index[j];
    if (i < 0 || (uint)i >= n) return;  // a malformed index never writes outside the subgroup
    float p = master[i];
    const float missed = step - fmax(last_step[i], start);
    const float steps = fmax(missed, 1.0f);  // a resent element (or a corrupt last_step) moves at least one step
    float g = load_value(value, j) / steps;
    float s = load_value(square, j) / steps;
    if (l2 != 0.0f) {  // torch.optim.Adam's weight_decay: grad + wd * p, here at the current p for the whole wait
        const float d = l2 * p;
        s = s + 2.0f * g * d + d * d;
        g = g + d;
    }
    const float keep1 = pow(beta1, steps), keep2 = pow(beta2, steps);
    const float m = keep1 * exp_avg[i] + (1.0f - keep1) * g;
    const float v = keep2 * exp_avg_sq[i] + (1.0f - keep2) * s;
    p = p + (-steps * step_size) * m / (sqrt(v) / bc2_sqrt + eps);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    last_step[i] = step;
    param_out[i] = p;
}
