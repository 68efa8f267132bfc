// Hopper pieces shared by the wgmma GEMMs (fp8_gemm.cu, bf16_gemm.cu): the shared-memory
// descriptor of a 128-byte-swizzled K-major tile, mbarriers, TMA tile copies and their tensor
// maps, register reallocation between warpgroups, and the search for a grouped GEMM's row tile.
// sm_90a (the mbarrier, TMA and descriptor pieces serve sm_100a too); CUDA C++ only.
#ifndef MOESERVE_KERNELS_CUDA_HOPPER_CUH
#define MOESERVE_KERNELS_CUDA_HOPPER_CUH

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "kernels/cuda/cuda_ops.h"

// The wgmma kernels (fp8_gemm.cu, bf16_gemm.cu) exist for Hopper alone: the same files are built
// for Blackwell too (sm_100a, which has no wgmma), where their bodies are a trap behind
// MOESERVE_WGMMA_DEVICE 0, and the host takes them only on a device of compute capability 9.x
// (cuda_wgmma_device), the others falling back to the mma.sync tiles and cuBLASLt.
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOESERVE_WGMMA_DEVICE 1
#else
#define MOESERVE_WGMMA_DEVICE 0
#endif
static inline bool cuda_wgmma_device() {
    static int hopper = -1; // one device a process
    if (hopper < 0) {
        int dev = 0, major = 0;
        hopper =
            cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
            major == 9;
    }
    return hopper;
}

// Smem layout of a tile (128-byte rows): row r at 128 r, its 16-byte chunk c at chunk c ^ (r % 8),
// the tile 1024-byte aligned: the 128-byte swizzle that TMA writes and the descriptors name.
// The wgmma descriptor of a K-major tile with the 128-byte swizzle at shared address addr: start
// address >> 4 (bits 0-13), leading byte offset 1 (unused by this layout), stride byte offset
// 1024 >> 4 between groups of eight rows (bits 32-45), layout type 1 (bits 62-63).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}
// The same for 64-byte rows with the 64-byte swizzle (chunk c of row r at chunk c ^ (r / 2 % 4),
// the tile 512-byte aligned): stride 512 >> 4, layout type 2.
__device__ __forceinline__ uint64_t wgmma_desc_sw64(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(512 >> 4) << 32 |
           (uint64_t)2 << 62;
}
// Byte offset off in a tile of rows of ROW_BYTES (128: the 128-byte swizzle, 64: the 64-byte
// one), swizzled as TMA writes it and the descriptors above read it (the tile 1024-byte
// aligned): its 16-byte unit's bits xor the bits of off above 128 bytes.
template <int ROW_BYTES> __device__ __forceinline__ uint32_t swizzled(uint32_t off) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "a swizzle of 128 or 64 bytes");
    return off ^ (((off >> 7) & (ROW_BYTES == 128 ? 7u : 3u)) << 4);
}

// The accumulator operands of a wgmma m64nN (N / 2 fp32 registers a thread, d[0 .. N / 2 - 1]):
// WGMMA_Dk_STR the placeholders %0 .. %(k-1) for the asm string, WGMMA_Dk_OUT(d) the matching
// read-write operands (the larger lists built from the smaller ones). The other operands follow
// from %k.
#define WGMMA_D32_STR                                                                              \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "                                           \
    "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "                                 \
    "%24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_D32_OUT(d)                                                                           \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]),            \
        "+f"((d)[6]), "+f"((d)[7]), "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]),      \
        "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), "+f"((d)[16]), "+f"((d)[17]),  \
        "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]),  \
        "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]),  \
        "+f"((d)[30]), "+f"((d)[31])
#define WGMMA_D64_STR                                                                              \
    WGMMA_D32_STR ", "                                                                             \
                  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "                   \
                  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "                   \
                  "%56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_D64_OUT(d) WGMMA_D32_OUT(d), WGMMA_D32_OUT((d) + 32)
#define WGMMA_D128_STR                                                                             \
    WGMMA_D64_STR ", "                                                                             \
                  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, "                   \
                  "%76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, "                   \
                  "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, "                   \
                  "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "       \
                  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "       \
                  "%124, %125, %126, %127"
#define WGMMA_D128_OUT(d) WGMMA_D64_OUT(d), WGMMA_D64_OUT((d) + 64)

// d += a b over k16 in BF16, fp32 sums: a wgmma m64nNk16 with A (64 x 16) from each thread's four
// registers (PTX's fragment layout) and B (N rows of 16 k) through descriptor b; N 8 to 64 (the
// decode sizes' tiles: moe_lean.cu, scripts/bench_wgmma_rate.cu)
template <int N>
__device__ __forceinline__ void wgmma_rs_bf16(float *d, const uint32_t (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void wgmma_rs_bf16<8>(float *d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs_bf16<16>(float *d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_rs_bf16<24>(float *d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_rs_bf16<32>(float *d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, "
                 "1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_rs_bf16<48>(float *d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
                 "%22, %23}, {%24, %25, %26, %27}, %28, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_rs_bf16<64>(float *d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WGMMA_D32_STR "}, "
                 "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
                 : WGMMA_D32_OUT(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// A warp's search for tile y of the experts' tiles, in expert order, each expert's rows cut into
// tiles of bm, its first skip tiles left out: {expert, its first grouped row} in every lane, or
// expert -1 past the last tile. It counts the experts' tiles 32 experts at a time.
__device__ __forceinline__ int2 group_tile(const int32_t *offsets, int E, int y, int bm,
                                           int skip = 0) {
    const int lane = threadIdx.x & 31;
    for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        int lo = 0, n = 0;
        if (e < E) {
            lo = __ldg(&offsets[e]);
            n = max(0, (__ldg(&offsets[e + 1]) - lo + bm - 1) / bm - skip);
            lo += skip * bm;
        }
        int incl = n; // tiles of experts e0 .. e
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, y < incl && y >= incl - n && n > 0);
        if (hit) {
            const int l = __ffs(hit) - 1, first = lo + (y - (incl - n)) * bm;
            return make_int2(e0 + l, __shfl_sync(0xffffffffu, first, l));
        }
        y -= __shfl_sync(0xffffffffu, incl, 31);
    }
    return make_int2(-1, 0);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// bytes the phase waits for, announced without an arrival
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// one arrival that also announces bytes the phase waits for
__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// until the phase of bar with this parity has completed (a fresh barrier: parity 1 at once)
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
    asm volatile("{\n"
                 ".reg .pred P1;\n"
                 "WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\n"
                 "bra WAIT;\n"
                 "DONE:\n"
                 "}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
// one arrival on the barrier at bar's offset in the shared memory of cluster block rank
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, int rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// every thread of the cluster's blocks
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}
// the box of map at (column x, row y) into shared memory at dst, its bytes counted on bar
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int x, int y,
                                            uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
                 : "memory");
}
// the same box into dst and bar's offsets in the shared memory of each cluster block in mask
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap *map, int x,
                                                      int y, uint32_t bar, uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(mask)
                 : "memory");
}
// bytes from global memory to shared memory in one bulk copy, counted on bar
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes,
                                          uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Stores by TMA: the box of map at (column x, row y) from shared memory at src (rows past the
// map's last are not written), committed into this thread's bulk group; the shared memory a
// thread wrote for it must be made visible to the copy engine first (fence_proxy_async, then a
// barrier). bulk_wait_read<N>: until at most N of this thread's groups still read their shared
// memory; bulk_wait<N>: until at most N are still writing.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(src), "r"(x), "r"(y)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// the named barrier id of count threads (whole warps; id 0 is __syncthreads')
__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// the same barrier's arrival without the wait (a producer's side of it)
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// setmaxnreg's count is an immediate
template <int R> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R) : "memory");
}
template <int R> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R) : "memory");
}

// The tensor map of a row-major byte matrix [rows, row_bytes] (row_bytes % 128 == 0, 16-byte
// aligned) in boxes of 128 bytes x box_rows rows with the 128-byte swizzle (box_bytes 64: 64-byte
// boxes, the 64-byte swizzle); rows past the last read as zeros. (A BF16 matrix is a byte matrix
// of twice its width: a box holds 64 of its k.) With plain, no swizzle: boxes of any multiple of
// 16 bytes, row_bytes a multiple of 16.
static inline CUtensorMap tma_map_rows(const void *base, int64_t rows, int64_t row_bytes,
                                       int box_rows, int box_bytes = 128, bool plain = false) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
    if (!encode) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn,
                                                                 12000, cudaEnableDefault, &q);
        if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn)
            cuda_fail(__FILE__, __LINE__,
                      "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)",
                      err != cudaSuccess ? cudaGetErrorString(err) : "the driver lacks it");
        encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    CUtensorMap map;
    const cuuint64_t dim[2] = {(cuuint64_t)row_bytes, (cuuint64_t)rows};
    const cuuint64_t stride[1] = {(cuuint64_t)row_bytes};
    const cuuint32_t box[2] = {(cuuint32_t)box_bytes, (cuuint32_t)box_rows}, unit[2] = {1, 1};
    const CUresult r =
        encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void *>(base), dim, stride, box,
               unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
               plain             ? CU_TENSOR_MAP_SWIZZLE_NONE
               : box_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                 : CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        char msg[96];
        snprintf(msg, sizeof msg, "CUresult %d for %lld rows x %lld bytes", (int)r, (long long)rows,
                 (long long)row_bytes);
        cuda_fail(__FILE__, __LINE__, "cuTensorMapEncodeTiled", msg);
    }
    return map;
}

#endif
