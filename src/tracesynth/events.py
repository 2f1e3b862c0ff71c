"""Event naming every reader maps onto (lttng-modules names; perf, strace and old LTTng map onto them)."""

SYSCALL_ENTRY = "syscall_entry_"
SYSCALL_EXIT = "syscall_exit_"
SCHED_SWITCH = "sched_switch"
SCHED_PROCESS_EXIT = "sched_process_exit"  # the thread never runs again after it

# LTTng 2.5 and older: `sys_NAME` entries and one `exit_syscall` (with `ret`) for every call
LEGACY_SYSCALL_ENTRY = "sys_"
LEGACY_SYSCALL_EXIT = "exit_syscall"

# the kernel's error returns are -MAX_ERRNO..-1 (include/linux/err.h)
MAX_ERRNO = 4095
# every CPU's idle task has pid 0, so tid 0 is current on several CPUs at once
IDLE_TID = 0
