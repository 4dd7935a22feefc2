#include "textflag.h"

// The stub's entry point (the linker's -E, EntryLdflags): the kernel starts
// the process here with argc at 0(SP) and argv from 8(SP). Nothing of Go's
// runtime has run, and nothing of it will.
TEXT ·Entry(SB), NOSPLIT|NOFRAME, $0-0
	MOVQ	0(SP), R12		// argc
	LEAQ	8(SP), R13		// argv
	// tlsArea[0] = &fakeG; arch_prctl(ARCH_SET_FS, &tlsArea[1]): Go code
	// reads its g at FS-8.
	LEAQ	·fakeG(SB), AX
	MOVQ	AX, ·tlsArea(SB)
	MOVQ	$0x1002, DI		// ARCH_SET_FS
	LEAQ	·tlsArea+8(SB), SI
	MOVQ	$158, AX		// SYS_arch_prctl
	SYSCALL
	CMPQ	AX, $0
	JNE	fail
	// bareMain(argc, argv, onSignal) int, on a 16-byte aligned stack.
	ANDQ	$~15, SP
	SUBQ	$32, SP
	MOVQ	R12, 0(SP)
	MOVQ	R13, 8(SP)
	LEAQ	·onSignal(SB), AX
	MOVQ	AX, 16(SP)
	CALL	·bareMain(SB)
	MOVQ	24(SP), DI
	MOVQ	$231, AX		// SYS_exit_group
	SYSCALL
	HLT
fail:
	MOVQ	$127, DI
	MOVQ	$231, AX		// SYS_exit_group
	SYSCALL
	HLT

// onSignal is a signal handler (the kernel calls it with the C ABI, the
// signal in DI): exit_group(0).
TEXT ·onSignal(SB), NOSPLIT|NOFRAME, $0-0
	MOVQ	$0, DI
	MOVQ	$231, AX		// SYS_exit_group
	SYSCALL
	HLT
