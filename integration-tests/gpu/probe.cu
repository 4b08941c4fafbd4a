// A CUDA probe for the GPU smoke check (smoke.sh): what a tenant container sees of
// its lease. Prints the device, the SMs and memory CUDA reports, runs a kernel and
// checks its result, then tries to allocate ALLOC_GIB GiB (argv[1], default 1) and
// says whether it could. Built on the GPU host with nvcc (static cudart), so the
// container needs only libc and the driver's libcuda bind-mounted by the runtime.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

__global__ void add(const float *a, const float *b, float *c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

static int fail(const char *what, cudaError_t e) {
    printf("PROBE FAIL %s: %s\n", what, cudaGetErrorString(e));
    return 1;
}

int main(int argc, char **argv) {
    double gib = argc > 1 ? atof(argv[1]) : 1.0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return fail("cudaGetDeviceCount", e);
    printf("PROBE devices %d\n", n);
    cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, 0);
    if (e != cudaSuccess) return fail("cudaGetDeviceProperties", e);
    printf("PROBE device0 %s sms %d\n", p.name, p.multiProcessorCount);
    size_t free_b = 0, total_b = 0;
    e = cudaMemGetInfo(&free_b, &total_b);
    if (e != cudaSuccess) return fail("cudaMemGetInfo", e);
    printf("PROBE mem free_mib %zu total_mib %zu\n", free_b >> 20, total_b >> 20);
    const int N = 1 << 20;
    const size_t bytes = N * sizeof(float);
    float *ha = (float *)malloc(bytes), *hb = (float *)malloc(bytes), *hc = (float *)malloc(bytes);
    for (int i = 0; i < N; i++) { ha[i] = 1.0f * i; hb[i] = 2.0f; }
    float *a, *b, *c;
    if ((e = cudaMalloc(&a, bytes)) != cudaSuccess) return fail("alloc a", e);
    if ((e = cudaMalloc(&b, bytes)) != cudaSuccess) return fail("alloc b", e);
    if ((e = cudaMalloc(&c, bytes)) != cudaSuccess) return fail("alloc c", e);
    cudaMemcpy(a, ha, bytes, cudaMemcpyHostToDevice);
    cudaMemcpy(b, hb, bytes, cudaMemcpyHostToDevice);
    add<<<(N + 255) / 256, 256>>>(a, b, c, N);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail("kernel launch", e);
    if ((e = cudaDeviceSynchronize()) != cudaSuccess) return fail("kernel", e);
    if ((e = cudaMemcpy(hc, c, bytes, cudaMemcpyDeviceToHost)) != cudaSuccess) return fail("copy back", e);
    int bad = 0;
    for (int i = 0; i < N; i++) if (hc[i] != 1.0f * i + 2.0f) bad++;
    printf("PROBE kernel %s (%d wrong)\n", bad ? "WRONG" : "ok", bad);
    void *big = nullptr;
    size_t want = (size_t)(gib * (double)(1ull << 30));
    e = cudaMalloc(&big, want);
    printf("PROBE alloc %.1f GiB %s\n", gib, e == cudaSuccess ? "ok" : cudaGetErrorString(e));
    if (big) cudaFree(big);
    printf("PROBE done\n");
    return bad ? 1 : 0;
}
