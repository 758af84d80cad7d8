/* LD_PRELOAD shim for tests/update/test_generic_cpu.py: every CPUID instruction executed after load reports family
 * 0x1A (AMD Zen 5), which the LLVM 14 inside PyPI's PoCL does not know, so llvm::sys::getHostCPUName() returns
 * "generic" exactly as on such a cloud VM. It uses the kernel's CPUID faulting (arch_prctl ARCH_SET_CPUID): each
 * cpuid traps to SIGSEGV, the handler runs the real instruction with faulting briefly off, edits leaf 1's family
 * and steps over it. Exit status 77 where the CPU or hypervisor offers no CPUID faulting. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static void on_cpuid(int sig, siginfo_t *info, void *raw) {
  (void)sig, (void)info;
  greg_t *reg = ((ucontext_t *)raw)->uc_mcontext.gregs;
  const unsigned char *ip = (const unsigned char *)reg[REG_RIP];
  if (ip[0] != 0x0f || ip[1] != 0xa2) { /* a real fault, not cpuid: die of it */
    signal(SIGSEGV, SIG_DFL);
    return;
  }
  unsigned leaf = (unsigned)reg[REG_RAX], a, b, c, d;
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
  __cpuid_count(leaf, (unsigned)reg[REG_RCX], a, b, c, d);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
  if (leaf == 1) /* family = base 0xF + extended 0xB = 0x1A */
    a = (a & ~0x0ff00f00u) | (0xfu << 8) | (0x0bu << 20);
  reg[REG_RAX] = a, reg[REG_RBX] = b, reg[REG_RCX] = c, reg[REG_RDX] = d;
  reg[REG_RIP] += 2;
}

__attribute__((constructor)) static void report_unknown_family(void) {
  struct sigaction action = {0};
  action.sa_sigaction = on_cpuid;
  action.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &action, NULL);
  if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0)
    _exit(77);
}
