// isa_probe: runs one instruction of each x86 extension servelm's CPU paths choose by, each in
// a child process, and prints "name 1" (it ran and gave the right answer) or "name 0".
//
// Why: a CPU flag is not proof that an instruction set is usable. A virtual machine may
// advertise a flag it does not honour, and AMX tile data needs the kernel's permission
// (arch_prctl ARCH_REQ_XCOMP_PERM) before the first tile instruction, or the process dies of
// SIGILL. A probe that dies here kills one child, never the server.
//
// Built by servelm/cpu_kernels/isa.py with the system C compiler, without -march flags: each
// test function carries its own target attribute, so main() itself uses none of them.

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static volatile float g_one = 1.0f;  // volatile: the compiler cannot fold the tests away

__attribute__((target("avx2,fma"))) static int t_avx2(void) {
  __m256 a = _mm256_set1_ps(g_one);
  a = _mm256_fmadd_ps(a, a, a);  // 2 in every lane
  float out[8];
  _mm256_storeu_ps(out, a);
  return out[7] == 2.0f;
}

__attribute__((target("avx512f"))) static int t_avx512f(void) {
  __m512 a = _mm512_set1_ps(g_one);
  return _mm512_reduce_add_ps(_mm512_add_ps(a, a)) == 32.0f;
}

__attribute__((target("avx512f,avx512bf16"))) static int t_avx512_bf16(void) {
  // 32 bf16 pairs of 1.0 dotted into 16 lanes: every lane gets 1*1 + 1*1 = 2.
  __m512 ones = _mm512_set1_ps(g_one);
  __m512bh b = _mm512_cvtne2ps_pbh(ones, ones);
  __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), b, b);
  return _mm512_reduce_add_ps(acc) == 32.0f;
}

__attribute__((target("avx512f,avx512vnni"))) static int t_avx512_vnni(void) {
  // u8 1 x s8 2, four per lane: 8 in each of 16 lanes.
  __m512i a = _mm512_set1_epi8((char)(int)g_one);
  __m512i b = _mm512_set1_epi8((char)(2 * (int)g_one));
  __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b);
  return _mm512_reduce_add_epi32(acc) == 128;
}

struct tile_config {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// One 16 x 16 float tile C += A (16 x 32 bf16) . B (16 pairs x 16 x 2 bf16), all ones: 32.
// Each AMX test asks for tile state and loads its configuration itself: moved into a shared
// function the configuration did not survive the return here (the tests then failed).
__attribute__((target("amx-tile,amx-bf16"))) static int t_amx_bf16(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
  struct tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  static uint16_t a[16 * 32], b[16 * 32];
  static float c[16 * 16];
  const uint16_t one = 0x3F80 * (uint16_t)g_one;  // bfloat16 1.0
  for (int i = 0; i < 16 * 32; ++i) a[i] = b[i] = one;
  _tile_zero(0);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0] == 32.0f && c[255] == 32.0f;
}

__attribute__((target("amx-tile,amx-int8"))) static int t_amx_int8(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
  struct tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  static int8_t a[16 * 64], b[16 * 64];
  static int32_t c[16 * 16];
  for (int i = 0; i < 16 * 64; ++i) a[i] = b[i] = (int8_t)(int)g_one;
  _tile_zero(0);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbssd(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0] == 64 && c[255] == 64;
}

static const struct {
  const char* name;
  int (*run)(void);
} kTests[] = {
    {"avx2", t_avx2},           {"avx512f", t_avx512f},   {"avx512_bf16", t_avx512_bf16},
    {"avx512_vnni", t_avx512_vnni}, {"amx_bf16", t_amx_bf16}, {"amx_int8", t_amx_int8},
};

int main(int argc, char** argv) {
  for (size_t i = 0; i < sizeof kTests / sizeof kTests[0]; ++i) {
    int wanted = argc < 2;
    for (int a = 1; a < argc; ++a) wanted |= strcmp(argv[a], kTests[i].name) == 0;
    if (!wanted) continue;
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) _exit(kTests[i].run() ? 0 : 1);
    int status = 0;
    const int ok = pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
                   WEXITSTATUS(status) == 0;
    printf("%s %d\n", kTests[i].name, ok);
  }
  return 0;
}
