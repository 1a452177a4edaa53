/* Does this CPU run the AMX instructions it advertises?
 *
 * llama.cpp built for the box (-march=native) uses AMX tiles for its quantized
 * products wherever CPUID advertises AMX-TILE and Linux grants the tile state.
 * Some Intel VMs do both and still fault on the first tile instruction: on one
 * (Xeon model 0xa7 stepping 8, 2 vCPUs) `ldtilecfg` in ggml_backend_amx_mul_mat
 * died of SIGSEGV, taking the agent with it. A fault cannot be caught inside the
 * process, so a forked child tries the same steps llama.cpp takes (ask Linux for the
 * tile state, load a palette-1 tile config, zero a tile, release) and the parent
 * reads how it ended. The child makes system calls and tile instructions only,
 * which is safe after fork() in a process with threads.
 *
 * Loaded with ctypes (node_agent/engines/llamacpp/library.py); built by
 * setuptools as an extension module only so that pip compiles it.
 */
#include <signal.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* arch/x86/include/uapi/asm/prctl.h and the XSAVE feature number of tile data,
 * as ggml-cpu/amx/amx.cpp uses them. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static int advertises_amx_tile(void) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    return (edx >> 24) & 1; /* CPUID.(EAX=7,ECX=0):EDX[24] AMX-TILE */
}

__attribute__((target("amx-tile"))) static void use_a_tile(void) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1; /* the palette llama.cpp loads: 16 rows of 64 bytes at most */
    config.rows[0] = 16;
    config.colsb[0] = 64;
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_release();
}

/* 0 when AMX is not advertised, not granted, or runs; else the signal that ended the
 * child (SIGILL, SIGSEGV) when it faults; -1 when no child could be started. */
int edgebus_amx_fault(void) {
    if (!advertises_amx_tile()) return 0;
    pid_t child = fork();
    if (child < 0) return -1;
    if (child == 0) {
        /* Die of the fault, quietly: the parent's handlers (Python's faulthandler
         * prints a traceback) are not this child's business. */
        signal(SIGILL, SIG_DFL);
        signal(SIGSEGV, SIG_DFL);
        signal(SIGBUS, SIG_DFL);
        /* Refused: llama.cpp is refused too, and keeps off AMX by itself. */
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) _exit(0);
        use_a_tile();
        _exit(0);
    }
    int status = 0;
    while (waitpid(child, &status, 0) < 0) {
        if (errno == EINTR) continue;
        return -1;
    }
    return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}
#else
int edgebus_amx_fault(void) { return 0; } /* no AMX on this architecture */
#endif
