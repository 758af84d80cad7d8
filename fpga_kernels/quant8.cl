// Block-wise 8-bit optimizer state (offload.state_precision=8bit, update/quant8.py) on the near-storage device:
// the state arrives from the device's own storage quantized, is widened here for the optimizer kernel, and is
// quantized again before it goes back, so only 8-bit state crosses the device's link.
//
// A quantized tensor of n elements is one buffer: n codes (uchar), then, from byte scales_at (4-aligned), one
// absmax (float) per block of BLOCK elements. The arithmetic is the host's (update/quant8.cpp) in the same fp32
// operations: y = value / absmax clamped to the map's range, the nearer of the two map values around y (the lower
// one on a tie), found through a table by fp32 bucket; widened = map[code] * absmax. The program is built with
// -cl-fp32-correctly-rounded-divide-sqrt, so the division rounds as the host's does.

#pragma OPENCL FP_CONTRACT OFF

#define BLOCK 2048

inline int sortable(float value) {
    int bits = as_int(value);
    return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

// One work-item per element.
__kernel void dequantize8(__global const uchar* raw, const uint scales_at, __constant float* table,
                          __global float* out, const uint n) {
    const uint i = get_global_id(0);
    if (i >= n) return;
    __global const float* scales = (__global const float*)(raw + scales_at);
    out[i] = table[raw[i]] * scales[i / BLOCK];
}

// One work-item per block: its absmax, then each element's code. direct[bucket] is the code of every value in the
// bucket, or -1 where the nearest map value changes inside it; below[bucket] the largest map value at or below the
// bucket's first value.
__kernel void quantize8(__global const float* values, __global uchar* raw, const uint scales_at,
                        __constant float* table, __global const short* direct, __global const short* below,
                        const int offset, const int buckets, const int shift, const float lowest, const uint n) {
    const uint b = get_global_id(0);
    const uint start = b * BLOCK;
    if (start >= n) return;
    const uint end = min(n, start + BLOCK);
    float absmax = 0.0f;
    for (uint i = start; i < end; ++i) absmax = fmax(absmax, fabs(values[i]));
    __global float* scales = (__global float*)(raw + scales_at);
    scales[b] = absmax;
    if (end == n) {  // the padding before the absmax values: files equal run to run
        for (uint i = n; i < scales_at; ++i) raw[i] = 0;
    }
    const float divisor = absmax > 0.0f ? absmax : 1.0f;
    for (uint i = start; i < end; ++i) {
        float y = values[i] / divisor;
        y = fmin(fmax(y, lowest), 1.0f);
        const int bucket = clamp((sortable(y) >> shift) + offset, 0, buckets - 1);
        const short known = direct[bucket];
        if (known >= 0) {
            raw[i] = (uchar)known;
            continue;
        }
        int lo = below[bucket];
        if (lo < 255 && table[lo + 1] <= y) ++lo;
        const int hi = min(lo + 1, 255);
        raw[i] = (uchar)((y - table[lo]) <= (table[hi] - y) ? lo : hi);
    }
}
