// SmartComp decompression on the near-storage device: zero-fill the subgroup's gradient buffer, then scatter the
// received top-k values into it. The optimizer kernel (optimizers.cl) runs next on the dense fp32 gradient, so
// the dense gradient never crosses the host link.
//   VALUE_FORMAT  1 = bf16, 2 = fp16   (the 16-bit values on the wire; indices are int32)

#ifndef VALUE_FORMAT
#define VALUE_FORMAT 1
#endif

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
#if VALUE_FORMAT == 1
    grad[i] = as_float(((uint)value[j]) << 16);
#else
    grad[i] = vload_half(j, (__global const half*)value);
#endif
}
