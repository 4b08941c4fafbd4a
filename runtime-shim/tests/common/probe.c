/* Static syscall probe for tessera-runtime's container tests: issues one raw syscall and
 * prints "<name> ok" or "<name> errno=<n>". Built with `cc -static` into the rootfs. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static int report(const char *name, long r) {
    if (r < 0) {
        printf("%s errno=%d\n", name, errno);
    } else {
        printf("%s ok\n", name);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: probe open PATH | open_ro PATH | clone3 | clone_newuser | bpf | perf_event_open | ptrace | userfaultfd | io_uring_setup | keyctl | mknod_char PATH\n");
        return 2;
    }
    const char *what = argv[1];
    if (!strcmp(what, "open") && argc > 2) {
        char name[512];
        snprintf(name, sizeof name, "open %s", argv[2]);
        return report(name, open(argv[2], O_RDWR));
    }
    if (!strcmp(what, "open_ro") && argc > 2) {
        char name[512];
        snprintf(name, sizeof name, "open_ro %s", argv[2]);
        return report(name, open(argv[2], O_RDONLY));
    }
    if (!strcmp(what, "clone3")) {
        char args[88];
        memset(args, 0, sizeof args);
        long r = syscall(435 /* clone3 */, args, sizeof args);
        if (r == 0) _exit(0);
        if (r > 0) waitpid((pid_t)r, NULL, 0);
        return report(what, r);
    }
    if (!strcmp(what, "clone_newuser")) {
        long r = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
        if (r == 0) _exit(0);
        if (r > 0) waitpid((pid_t)r, NULL, 0);
        return report(what, r);
    }
    if (!strcmp(what, "fork")) {
        long r = syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
        if (r == 0) _exit(0);
        if (r > 0) waitpid((pid_t)r, NULL, 0);
        return report(what, r);
    }
    if (!strcmp(what, "bpf")) {
        char attr[128];
        memset(attr, 0, sizeof attr);
        return report(what, syscall(SYS_bpf, 0 /* BPF_MAP_CREATE */, attr, sizeof attr));
    }
    if (!strcmp(what, "perf_event_open")) {
        char attr[128];
        memset(attr, 0, sizeof attr);
        return report(what, syscall(SYS_perf_event_open, attr, 0, -1, -1, 0));
    }
    if (!strcmp(what, "ptrace")) {
        return report(what, syscall(SYS_ptrace, 16 /* PTRACE_ATTACH */, 1, 0, 0));
    }
    if (!strcmp(what, "userfaultfd")) {
        return report(what, syscall(SYS_userfaultfd, 0));
    }
    if (!strcmp(what, "io_uring_setup")) {
        char params[120];
        memset(params, 0, sizeof params);
        return report(what, syscall(425 /* io_uring_setup */, 1, params));
    }
    if (!strcmp(what, "keyctl")) {
        return report(what, syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3, 0));
    }
    if (!strcmp(what, "mknod_char") && argc > 2) {
        return report(what, syscall(SYS_mknodat, AT_FDCWD, argv[2], 020666, (195 << 8) | 1));
    }
    fprintf(stderr, "unknown probe %s\n", what);
    return 2;
}
