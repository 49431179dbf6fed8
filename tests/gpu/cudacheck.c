/* cudacheck: proves that the NVIDIA driver injected into a container runs a kernel, with no CUDA
 * toolkit in the image. It dlopens libcuda.so.1 (the injected driver), loads a PTX kernel with
 * cuModuleLoadData (the driver JIT-compiles it for the GPU it finds), launches it on every device
 * it sees and checks each result. One line per device:
 *     device 0 GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx 0000:00:06.0 kernel ok
 * preceded by "devices N". Exit status 0 only when every device ran the kernel right.
 * With CUDACHECK_BUSY_SECONDS=N in the environment it then keeps each device busy with the same
 * kernel for N seconds (NVML's utilisation near 100 %), for the daemon's GPU sampling test.
 * Built by tests/gpu/prepare_daemon_bundle.sh (gcc, glibc of Debian 12); used by
 * tests/gpu/test_daemon_gpu.py, where the booker runs it over SSH. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned char bytes[16]; } CUuuid;

static const char PTX[] =
    ".version 7.0\n"
    ".target sm_80\n"
    ".address_size 64\n"
    ".visible .entry square_plus(\n"
    "    .param .u64 square_plus_out,\n"
    "    .param .u32 square_plus_n,\n"
    "    .param .u32 square_plus_add\n"
    ")\n"
    "{\n"
    "    .reg .pred %p<2>;\n"
    "    .reg .b32 %r<8>;\n"
    "    .reg .b64 %rd<5>;\n"
    "    ld.param.u64 %rd1, [square_plus_out];\n"
    "    ld.param.u32 %r1, [square_plus_n];\n"
    "    ld.param.u32 %r2, [square_plus_add];\n"
    "    mov.u32 %r3, %ctaid.x;\n"
    "    mov.u32 %r4, %ntid.x;\n"
    "    mov.u32 %r5, %tid.x;\n"
    "    mad.lo.s32 %r6, %r3, %r4, %r5;\n"
    "    setp.ge.u32 %p1, %r6, %r1;\n"
    "    @%p1 bra $L_done;\n"
    "    cvta.to.global.u64 %rd2, %rd1;\n"
    "    mul.wide.u32 %rd3, %r6, 4;\n"
    "    add.s64 %rd4, %rd2, %rd3;\n"
    "    mad.lo.s32 %r7, %r6, %r6, %r2;\n"
    "    st.global.u32 [%rd4], %r7;\n"
    "$L_done:\n"
    "    ret;\n"
    "}\n";

static void *cuda;

static void *sym(const char *name) {
    void *found = dlsym(cuda, name);
    if (found == NULL) {
        printf("error: libcuda.so.1 has no %s\n", name);
        exit(2);
    }
    return found;
}

static const char *describe(CUresult rc) {
    CUresult (*get_string)(CUresult, const char **) = dlsym(cuda, "cuGetErrorString");
    const char *text = NULL;
    if (get_string == NULL || get_string(rc, &text) != 0 || text == NULL) return "unknown error";
    return text;
}

#define CHECK(call, what)                                                         \
    do {                                                                          \
        CUresult rc_ = (call);                                                    \
        if (rc_ != 0) {                                                           \
            printf("error: %s failed: %d %s\n", what, rc_, describe(rc_));        \
            return 1;                                                             \
        }                                                                         \
    } while (0)

static int run_on(int ordinal) {
    CUresult (*device_get)(CUdevice *, int) = sym("cuDeviceGet");
    CUresult (*get_uuid)(CUuuid *, CUdevice) = dlsym(cuda, "cuDeviceGetUuid_v2");
    CUresult (*bus_id)(char *, int, CUdevice) = sym("cuDeviceGetPCIBusId");
    CUresult (*retain)(CUcontext *, CUdevice) = sym("cuDevicePrimaryCtxRetain");
    CUresult (*release)(CUdevice) = sym("cuDevicePrimaryCtxRelease_v2");
    CUresult (*set_current)(CUcontext) = sym("cuCtxSetCurrent");
    CUresult (*load)(CUmodule *, const void *) = sym("cuModuleLoadData");
    CUresult (*load_ex)(CUmodule *, const void *, unsigned, int *, void **) = sym("cuModuleLoadDataEx");
    CUresult (*function)(CUfunction *, CUmodule, const char *) = sym("cuModuleGetFunction");
    CUresult (*alloc)(CUdeviceptr *, size_t) = sym("cuMemAlloc_v2");
    CUresult (*release_memory)(CUdeviceptr) = sym("cuMemFree_v2");
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       CUstream, void **, void **) = sym("cuLaunchKernel");
    CUresult (*synchronize)(void) = sym("cuCtxSynchronize");
    CUresult (*copy_back)(void *, CUdeviceptr, size_t) = sym("cuMemcpyDtoH_v2");
    CUresult (*unload)(CUmodule) = sym("cuModuleUnload");
    if (get_uuid == NULL) get_uuid = sym("cuDeviceGetUuid");

    CUdevice device;
    CUuuid uuid;
    char bus[32] = "";
    CUcontext context;
    CUmodule module;
    CUfunction kernel;
    CUdeviceptr out;
    unsigned int n = 1u << 20, add = 7u + (unsigned)ordinal;
    CHECK(device_get(&device, ordinal), "cuDeviceGet");
    CHECK(get_uuid(&uuid, device), "cuDeviceGetUuid");
    CHECK(bus_id(bus, (int)sizeof bus, device), "cuDeviceGetPCIBusId");
    CHECK(retain(&context, device), "cuDevicePrimaryCtxRetain");
    CHECK(set_current(context), "cuCtxSetCurrent");
    CUresult loaded = load(&module, PTX);
    if (loaded != 0) {
        char log[4096] = "";
        int options[2] = {5, 6}; /* CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES */
        void *values[2] = {log, (void *)(uintptr_t)sizeof log};
        CUmodule again;
        load_ex(&again, PTX, 2, options, values);
        printf("error: cuModuleLoadData failed: %d %s; JIT log: %s\n", loaded, describe(loaded), log);
        return 1;
    }
    CHECK(function(&kernel, module, "square_plus"), "cuModuleGetFunction");
    CHECK(alloc(&out, n * sizeof(uint32_t)), "cuMemAlloc");
    void *params[] = {&out, &n, &add};
    CHECK(launch(kernel, (n + 255) / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL), "cuLaunchKernel");
    CHECK(synchronize(), "cuCtxSynchronize");
    uint32_t *host = malloc(n * sizeof(uint32_t));
    if (host == NULL) return 1;
    CHECK(copy_back(host, out, n * sizeof(uint32_t)), "cuMemcpyDtoH");
    const char *busy = getenv("CUDACHECK_BUSY_SECONDS");
    if (busy != NULL && atof(busy) > 0) {
        struct timespec began, now;
        clock_gettime(CLOCK_MONOTONIC, &began);
        do {
            for (int i = 0; i < 200; i++)
                CHECK(launch(kernel, (n + 255) / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL), "cuLaunchKernel");
            CHECK(synchronize(), "cuCtxSynchronize");
            clock_gettime(CLOCK_MONOTONIC, &now);
        } while ((double)(now.tv_sec - began.tv_sec) + (now.tv_nsec - began.tv_nsec) / 1e9 < atof(busy));
    }
    unsigned int wrong = 0;
    for (unsigned int i = 0; i < n; i++)
        if (host[i] != (uint32_t)(i * i + add)) wrong++;
    free(host);
    release_memory(out);
    unload(module);
    release(device);
    const unsigned char *b = uuid.bytes;
    printf("device %d GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x %s kernel %s\n",
           ordinal, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
           b[14], b[15], bus, wrong == 0 ? "ok" : "WRONG");
    if (wrong != 0) printf("error: %u of %u results wrong on device %d\n", wrong, n, ordinal);
    return wrong != 0;
}

int main(void) {
    cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda == NULL) {
        printf("error: dlopen libcuda.so.1: %s\n", dlerror());
        return 2;
    }
    CUresult (*init)(unsigned int) = sym("cuInit");
    CUresult (*count_of)(int *) = sym("cuDeviceGetCount");
    int count = 0;
    CHECK(init(0), "cuInit");
    CHECK(count_of(&count), "cuDeviceGetCount");
    printf("devices %d\n", count);
    int failed = count == 0;
    for (int ordinal = 0; ordinal < count; ordinal++) failed |= run_on(ordinal);
    fflush(stdout);
    return failed;
}
