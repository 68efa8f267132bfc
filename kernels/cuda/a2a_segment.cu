/* The one-sided transport's symmetric segment: this rank's share allocated, every peer's mapped
 * (kernels/cuda/a2a_cuda_internal.h). Three ways, one for every rank (MOESERVE_A2A_MEM, the same
 * on every rank; default auto):
 *   ipc       cudaMalloc + cudaIpcGetMemHandle / cudaIpcOpenMemHandle; the handles go round with
 *             MPI_Allgather. One node.
 *   posix_fd  cuMemCreate with a POSIX file descriptor handle, exported with
 *             cuMemExportToShareableHandle; the descriptors cross processes as SCM_RIGHTS over
 *             abstract Unix datagram sockets (one per rank, named after rank 0's pid and a
 *             serial that MPI broadcasts), then each peer's allocation is imported and mapped
 *             into a reserved range with read-write access for this device. One node.
 *   fabric    cuMemCreate with a fabric handle (CUmemFabricHandle, 64 bytes), exchanged with
 *             MPI_Allgather like the IPC handles: what multi-node NVLink (GB200 NVL72 and its
 *             IMEX channels) needs, as a fabric handle names memory across the NVLink domain.
 *   auto      fabric when every rank's device reports CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_
 *             SUPPORTED and the export and import work on every rank (an IMEX channel is
 *             there), ipc otherwise.
 * The driver API is reached through cudaGetDriverEntryPointByVersion, so nothing links libcuda
 * (the build machine has no driver). Every step that can fail on one rank is agreed on all
 * (MPI_Allreduce) before the next, so the ranks fail, or fall back, together. */
#include "kernels/cuda/a2a_cuda_internal.h"

#include "common/log.h"

#include <cuda.h>

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

const char *a2a_gpu_segment_kind(const a2a_gpu *a) {
    return a->cfg.transport == A2A_NVLINK_ONE_SIDED ? a2a_seg_kind_name(a->seg_kind) : "none";
}

const char *a2a_seg_kind_name(int kind) {
    return kind == A2A_SEG_POSIX_FD ? "posix_fd" : kind == A2A_SEG_FABRIC ? "fabric" : "ipc";
}

/* ---- the driver calls ---- */

static struct {
    bool loaded;
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_attr)(int *, CUdevice_attribute, CUdevice);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *,
                            CUmemAllocationGranularity_flags);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*addr_free)(CUdeviceptr, size_t);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*export_handle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                              unsigned long long);
    CUresult (*import_handle)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    CUresult (*error_string)(CUresult, const char **);
} drv;

static bool drv_load(char *err, size_t errlen) {
    if (drv.loaded) return true;
    static const struct {
        const char *name;
        void **fn;
    } syms[] = {
        {"cuDeviceGet", (void **)&drv.device_get},
        {"cuDeviceGetAttribute", (void **)&drv.device_attr},
        {"cuMemGetAllocationGranularity", (void **)&drv.granularity},
        {"cuMemCreate", (void **)&drv.create},
        {"cuMemRelease", (void **)&drv.release},
        {"cuMemAddressReserve", (void **)&drv.reserve},
        {"cuMemAddressFree", (void **)&drv.addr_free},
        {"cuMemMap", (void **)&drv.map},
        {"cuMemUnmap", (void **)&drv.unmap},
        {"cuMemSetAccess", (void **)&drv.set_access},
        {"cuMemExportToShareableHandle", (void **)&drv.export_handle},
        {"cuMemImportFromShareableHandle", (void **)&drv.import_handle},
        {"cuGetErrorString", (void **)&drv.error_string},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion(syms[i].name, syms[i].fn, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess || !*syms[i].fn) {
            a2a_gpu_errf(err, errlen, "the CUDA driver has no %s", syms[i].name);
            return false;
        }
    }
    drv.loaded = true;
    return true;
}

static const char *cu_str(CUresult r) {
    const char *s = NULL;
    if (drv.error_string) drv.error_string(r, &s);
    return s ? s : "unknown CUDA driver error";
}

#define CU_TRY(call, what)                                                                         \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            a2a_gpu_errf(err, errlen, "all-to-all rank %d: %s failed: %s", me, what, cu_str(r_));  \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* ---- cuMem: this rank's allocation, and a peer's mapped ---- */

static CUmemAllocationProp mem_prop(CUdevice dev, CUmemAllocationHandleType type) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = type;
    return prop;
}

/* Map handle h (bytes) into a new range with read-write access for this device. */
static int map_handle(CUmemGenericAllocationHandle h, size_t bytes, size_t align, CUdevice dev,
                      char **out, int me, char *err, size_t errlen) {
    CUdeviceptr va = 0;
    bool reserved = false;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_TRY(drv.reserve(&va, bytes, align, 0, 0), "cuMemAddressReserve");
    reserved = true;
    CU_TRY(drv.map(va, bytes, 0, h, 0), "cuMemMap");
    {
        const CUresult r = drv.set_access(va, bytes, &acc, 1);
        if (r != CUDA_SUCCESS) drv.unmap(va, bytes);
        CU_TRY(r, "cuMemSetAccess");
    }
    *out = (char *)(uintptr_t)va;
    return 0;
fail:
    if (reserved) drv.addr_free(va, bytes);
    return -1;
}

static void unmap_range(char *p, size_t bytes) {
    if (!p) return;
    drv.unmap((CUdeviceptr)(uintptr_t)p, bytes);
    drv.addr_free((CUdeviceptr)(uintptr_t)p, bytes);
}

/* ---- POSIX descriptors across processes ---- */

/* This rank's descriptor fd to every other rank; fds[p] = rank p's, imported here (-1 on
 * failure). Collective. */
static int fd_exchange(a2a_gpu *a, int fd, int *fds, char *err, size_t errlen) {
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    static int serial;
    int tag[2] = {(int)getpid(), serial++};
    MPI_Bcast(tag, 2, MPI_INT, 0, a->comm);
    struct sockaddr_un addr;
    socklen_t alen = 0;
    /* abstract names (leading NUL): nothing in the file system, gone with the socket */
    auto name = [&](int r) {
        memset(&addr, 0, sizeof addr);
        addr.sun_family = AF_UNIX;
        const int n = snprintf(addr.sun_path + 1, sizeof addr.sun_path - 1, "moeserve-a2a-%d-%d-%d",
                               tag[0], tag[1], r);
        alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
    };
    for (int p = 0; p < ep; p++)
        fds[p] = -1;
    int s = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    bool ok = s >= 0;
    if (ok) {
        name(me);
        ok = bind(s, (struct sockaddr *)&addr, alen) == 0;
    }
    if (!a2a_gpu_agree(a->comm, ok)) {
        if (s >= 0) close(s);
        return a2a_gpu_errf(err, errlen,
                            "all-to-all rank %d: a Unix socket for the descriptors: %s", me,
                            ok ? "another rank failed" : strerror(errno));
    }
    const double t_s = a->cfg.timeout_s > 0 ? a->cfg.timeout_s : 30.0;
    struct timeval tv = {(time_t)t_s, (suseconds_t)((t_s - (time_t)t_s) * 1e6)};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    for (int p = 0; p < ep && ok; p++) {
        if (p == me) continue;
        char cbuf[CMSG_SPACE(sizeof(int))];
        memset(cbuf, 0, sizeof cbuf);
        int from = me;
        struct iovec iov = {&from, sizeof from};
        struct msghdr m;
        memset(&m, 0, sizeof m);
        name(p);
        m.msg_name = &addr;
        m.msg_namelen = alen;
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = cbuf;
        m.msg_controllen = sizeof cbuf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
        if (sendmsg(s, &m, 0) < 0) {
            ok = false;
            a2a_gpu_errf(err, errlen,
                         "all-to-all rank %d: sending the segment's descriptor to rank %d: %s", me,
                         p, strerror(errno));
        }
    }
    for (int i = 0; i < ep - 1 && ok; i++) {
        char cbuf[CMSG_SPACE(sizeof(int))];
        int from = -1;
        struct iovec iov = {&from, sizeof from};
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = cbuf;
        m.msg_controllen = sizeof cbuf;
        if (recvmsg(s, &m, 0) != (ssize_t)sizeof from) {
            ok = false;
            a2a_gpu_errf(err, errlen,
                         "all-to-all rank %d: no segment descriptor from a peer within %g s: %s",
                         me, t_s, strerror(errno));
            break;
        }
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        if (from < 0 || from >= ep || from == me || !c || c->cmsg_type != SCM_RIGHTS ||
            fds[from] >= 0) {
            ok = false;
            a2a_gpu_errf(err, errlen, "all-to-all rank %d: a malformed descriptor message", me);
            break;
        }
        memcpy(&fds[from], CMSG_DATA(c), sizeof(int));
    }
    close(s);
    if (!a2a_gpu_agree(a->comm, ok)) {
        for (int p = 0; p < ep; p++)
            if (fds[p] >= 0) close(fds[p]);
        if (ok) a2a_gpu_errf(err, errlen, "all-to-all rank %d: another rank lost a descriptor", me);
        return -1;
    }
    return 0;
}

/* ---- the three ways ---- */

static int setup_ipc(a2a_gpu *a, char *err, size_t errlen) {
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    cudaIpcMemHandle_t h, *all = (cudaIpcMemHandle_t *)calloc((size_t)ep, sizeof h);
    cudaError_t e = cudaMalloc((void **)&a->seg, a->seg_bytes);
    bool ok = e == cudaSuccess;
    if (!ok) a2a_gpu_cuda_fail(err, errlen, me, "cudaMalloc of the segment", e);
    if (ok && (e = cudaIpcGetMemHandle(&h, a->seg)) != cudaSuccess) {
        a2a_gpu_cuda_fail(err, errlen, me, "cudaIpcGetMemHandle of the segment", e);
        ok = false;
    }
    if (!a2a_gpu_agree(a->comm, ok) ||
        MPI_Allgather(&h, (int)sizeof h, MPI_BYTE, all, (int)sizeof h, MPI_BYTE, a->comm) !=
            MPI_SUCCESS) {
        if (ok) a2a_gpu_errf(err, errlen, "all-to-all rank %d: another rank has no IPC handle", me);
        free(all);
        return -1;
    }
    for (int p = 0; p < ep && ok; p++) {
        if (p == me) {
            a->peer_host[p] = a->seg;
            continue;
        }
        void *ptr = NULL;
        e = cudaIpcOpenMemHandle(&ptr, all[p], cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            a2a_gpu_errf(
                err, errlen,
                "all-to-all rank %d: cudaIpcOpenMemHandle of rank %d's segment failed: %s "
                "(nvlink_one_sided needs every rank's GPU in one node with peer access; use "
                "nccl otherwise)",
                me, p, cudaGetErrorString(e));
            ok = false;
            break;
        }
        a->peer_host[p] = (char *)ptr;
    }
    free(all);
    return ok ? 0 : -1;
}

/* posix_fd or fabric. On failure everything this rank made is released. */
static int setup_cumem(a2a_gpu *a, int kind, char *err, size_t errlen) {
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    const CUmemAllocationHandleType type = kind == A2A_SEG_FABRIC
                                               ? CU_MEM_HANDLE_TYPE_FABRIC
                                               : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUdevice dev = 0;
    size_t gran = 0;
    int fd = -1, *fds = (int *)malloc((size_t)ep * sizeof(int));
    CUmemFabricHandle fh, *all = (CUmemFabricHandle *)calloc((size_t)ep, sizeof fh);
    CUmemGenericAllocationHandle *hs =
        (CUmemGenericAllocationHandle *)calloc((size_t)ep, sizeof *hs);
    bool ok = false;
    for (int p = 0; p < ep; p++)
        fds[p] = -1;
    {
        CU_TRY(drv.device_get(&dev, a->device), "cuDeviceGet");
        const CUmemAllocationProp prop = mem_prop(dev, type);
        CU_TRY(drv.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
               "cuMemGetAllocationGranularity");
        a->seg_map = (a->seg_bytes + gran - 1) / gran * gran;
        CU_TRY(drv.create(&hs[me], a->seg_map, &prop, 0),
               kind == A2A_SEG_FABRIC
                   ? "cuMemCreate of the segment with a fabric handle (it needs an IMEX channel, "
                     "as on GB200 NVL72; MOESERVE_A2A_MEM=ipc or posix_fd within one node)"
                   : "cuMemCreate of the segment");
        if (map_handle(hs[me], a->seg_map, gran, dev, &a->seg, me, err, errlen) != 0) goto fail;
        if (kind == A2A_SEG_FABRIC)
            CU_TRY(drv.export_handle(&fh, hs[me], type, 0),
                   "cuMemExportToShareableHandle (fabric)");
        else
            CU_TRY(drv.export_handle(&fd, hs[me], type, 0),
                   "cuMemExportToShareableHandle (POSIX descriptor)");
        ok = true;
    }
fail:
    if (!a2a_gpu_agree(a->comm, ok)) {
        if (ok)
            a2a_gpu_errf(err, errlen,
                         "all-to-all rank %d: another rank could not export its %s segment", me,
                         a2a_seg_kind_name(kind));
        ok = false;
        goto out;
    }
    ok = false;
    if (kind == A2A_SEG_FABRIC) {
        if (MPI_Allgather(&fh, (int)sizeof fh, MPI_BYTE, all, (int)sizeof fh, MPI_BYTE, a->comm) !=
            MPI_SUCCESS) {
            a2a_gpu_errf(err, errlen,
                         "all-to-all rank %d: MPI_Allgather of the fabric handles failed", me);
            goto out;
        }
    } else if (fd_exchange(a, fd, fds, err, errlen) != 0) {
        goto out;
    }
    ok = true;
    for (int p = 0; p < ep && ok; p++) {
        if (p == me) {
            a->peer_host[p] = a->seg;
            continue;
        }
        void *src = kind == A2A_SEG_FABRIC ? (void *)&all[p] : (void *)(uintptr_t)fds[p];
        CUresult r = drv.import_handle(&hs[p], src, type);
        if (r != CUDA_SUCCESS) {
            a2a_gpu_errf(err, errlen,
                         "all-to-all rank %d: cuMemImportFromShareableHandle of rank %d's %s "
                         "segment failed: %s",
                         me, p, a2a_seg_kind_name(kind), cu_str(r));
            hs[p] = 0;
            ok = false;
            break;
        }
        if (map_handle(hs[p], a->seg_map, gran, dev, &a->peer_host[p], me, err, errlen) != 0)
            ok = false;
    }
    ok = a2a_gpu_agree(a->comm, ok);
out:
    if (fd >= 0) close(fd);
    for (int p = 0; p < ep; p++)
        if (fds[p] >= 0) close(fds[p]);
    if (ok) {
        a->seg_handles = (unsigned long long *)hs;
        a->seg_kind = kind;
    } else { /* release what this rank made */
        for (int p = 0; p < ep; p++) {
            if (p != me && a->peer_host[p]) unmap_range(a->peer_host[p], a->seg_map);
            a->peer_host[p] = NULL;
            if (hs[p]) drv.release(hs[p]);
        }
        if (a->seg) unmap_range(a->seg, a->seg_map);
        a->seg = NULL;
        free(hs);
    }
    free(fds);
    free(all);
    return ok ? 0 : -1;
}

int a2a_segment_setup(a2a_gpu *a, char *err, size_t errlen) {
    const int me = a->cfg.rank;
    const char *env = getenv("MOESERVE_A2A_MEM");
    int want = -1; /* auto */
    if (env && *env && strcmp(env, "auto")) {
        want = !strcmp(env, "ipc")        ? A2A_SEG_IPC
               : !strcmp(env, "posix_fd") ? A2A_SEG_POSIX_FD
               : !strcmp(env, "fabric")   ? A2A_SEG_FABRIC
                                          : -2;
    }
    int v[2] = {want, -want}, m[2] = {0, 0};
    MPI_Allreduce(v, m, 2, MPI_INT, MPI_MAX, a->comm);
    if (m[0] != -m[1] || want == -2)
        return a2a_gpu_errf(
            err, errlen,
            "all-to-all rank %d: MOESERVE_A2A_MEM is '%s' here: it must be auto, ipc, "
            "posix_fd or fabric, the same on every rank",
            me, env ? env : "");
    if (want == A2A_SEG_IPC) return setup_ipc(a, err, errlen);
    char why[320] = "";
    bool have = drv_load(why, sizeof why);
    if (want == -1) { /* auto: fabric where every device has it and it works, else ipc */
        int fab = 0;
        CUdevice dev = 0;
        if (have && drv.device_get(&dev, a->device) == CUDA_SUCCESS)
            drv.device_attr(&fab, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev);
        if (a2a_gpu_agree(a->comm, have && fab)) {
            if (setup_cumem(a, A2A_SEG_FABRIC, why, sizeof why) == 0) return 0;
            if (me == 0)
                LOG_INFO("a2a",
                         "fabric handles reported but not usable (%s): the segment is "
                         "shared by CUDA IPC",
                         why);
        }
        return setup_ipc(a, err, errlen);
    }
    if (!a2a_gpu_agree(a->comm, have))
        return a2a_gpu_errf(err, errlen, "all-to-all rank %d: MOESERVE_A2A_MEM=%s: %s", me, env,
                            have ? "another rank has no cuMem driver calls" : why);
    return setup_cumem(a, want, err, errlen);
}

void a2a_segment_free(a2a_gpu *a) {
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    if (a->seg_kind == A2A_SEG_IPC) {
        if (a->peer_host)
            for (int p = 0; p < ep; p++)
                if (p != me && a->peer_host[p]) cudaIpcCloseMemHandle(a->peer_host[p]);
        cudaFree(a->seg);
    } else {
        CUmemGenericAllocationHandle *hs = (CUmemGenericAllocationHandle *)a->seg_handles;
        for (int p = 0; p < ep; p++) {
            if (p != me && a->peer_host && a->peer_host[p])
                unmap_range(a->peer_host[p], a->seg_map);
            if (hs && hs[p]) drv.release(hs[p]);
        }
        unmap_range(a->seg, a->seg_map);
        free(hs);
        a->seg_handles = NULL;
    }
    a->seg = NULL;
}
