/* The FUSE round-trip floor: a single-threaded server over the raw /dev/fuse protocol that
 * answers from memory (no libfuse, no disk). A measurement tool for bench/fuse_floor.py, not
 * product code. Usage: fuse_floor MOUNTPOINT (as root; mounts with mount(2) as `sandbox mount`
 * does). It negotiates the INIT flags and no-open mode `sandbox mount` negotiates, answers with
 * its watched mount's timeouts (60 s), and counts requests by opcode: SIGUSR1 prints one line
 * "NAME=count ..." on stdout. It exits when the mount goes away. Facts: <linux/fuse.h>. */
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define NODES_MAX 65536             /* nodes for the whole run; ids are never reused */
#define NAME_MAX_BYTES 255
#define FILE_BYTES_MAX 65536        /* a file's content in memory; a write past it is EFBIG */
#define TIMEOUT_S 60                /* COHERENT_ENTRY_VALID_S / COHERENT_ATTR_VALID_S */
#define MAX_WRITE (1 << 20)         /* as ours: 256 pages */
#define BUF_BYTES (MAX_WRITE + 65536)
#define OPCODES_MAX 64

struct node {
    int used, unlinked;
    uint64_t nlookup, parent, first, next; /* children: a list through first/next */
    char name[NAME_MAX_BYTES + 1];
    uint32_t mode;
    uint64_t size;
    char *data;
    struct timespec mtime, ctime;
};

static struct node nodes[NODES_MAX];
static uint64_t next_id = 2;
static uint64_t counts[OPCODES_MAX];
static char buf[BUF_BYTES];
static const char *names[OPCODES_MAX] = {
    [1] = "LOOKUP", [2] = "FORGET", [3] = "GETATTR", [4] = "SETATTR", [9] = "MKDIR", [10] = "UNLINK",
    [11] = "RMDIR", [14] = "OPEN", [15] = "READ", [16] = "WRITE", [17] = "STATFS", [18] = "RELEASE",
    [22] = "GETXATTR", [23] = "LISTXATTR", [25] = "FLUSH", [26] = "INIT", [27] = "OPENDIR", [28] = "READDIR",
    [29] = "RELEASEDIR", [34] = "ACCESS", [35] = "CREATE", [38] = "DESTROY", [42] = "BATCH_FORGET",
    [36] = "INTERRUPT", [39] = "IOCTL", [40] = "POLL", [44] = "READDIRPLUS", [46] = "LSEEK"};

/* SIGUSR1: the counts so far as one line on stdout, written from the handler itself with
 * write(2) only (async-signal-safe), so a request loop blocked in read(2) answers at once */
static void on_usr1(int sig) {
    char line[2048], digits[24];
    size_t used = 0;
    (void)sig;
    for (int i = 0; i < OPCODES_MAX; i++) {
        if (!counts[i]) continue;
        const char *name = names[i] ? names[i] : "OTHER";
        size_t nd = 0, len = strlen(name);
        for (uint64_t v = counts[i]; v || !nd; v /= 10) digits[nd++] = '0' + v % 10;
        if (used + len + nd + 2 >= sizeof line) break;
        memcpy(line + used, name, len), used += len, line[used++] = '=';
        while (nd) line[used++] = digits[--nd];
        line[used++] = ' ';
    }
    line[used++] = '\n';
    if (write(1, line, used) < 0) _exit(1);
}

static void reply(int fd, uint64_t unique, int error, const void *p, size_t n) {
    struct fuse_out_header h = {sizeof h + (error ? 0 : n), error ? -error : 0, unique};
    struct iovec iov[2] = {{&h, sizeof h}, {(void *)p, error ? 0 : n}};
    if (writev(fd, iov, 2) < 0 && errno != ENOENT) perror("fuse_floor: writev"); /* ENOENT: interrupted */
}

static struct node *get(uint64_t id) {
    return id >= 1 && id < next_id && nodes[id].used ? &nodes[id] : NULL;
}

static void fill_attr(uint64_t id, struct fuse_attr *a) {
    struct node *n = &nodes[id];
    memset(a, 0, sizeof *a);
    a->ino = id;
    a->size = n->size;
    a->blocks = (n->size + 511) / 512;
    a->mtime = a->atime = n->mtime.tv_sec;
    a->mtimensec = a->atimensec = n->mtime.tv_nsec;
    a->ctime = n->ctime.tv_sec;
    a->ctimensec = n->ctime.tv_nsec;
    a->mode = n->mode;
    a->nlink = S_ISDIR(n->mode) ? 2 : 1;
    a->blksize = 4096;
}

static void fill_entry(uint64_t id, struct fuse_entry_out *e) {
    memset(e, 0, sizeof *e);
    e->nodeid = id;
    e->generation = 1;
    e->entry_valid = e->attr_valid = TIMEOUT_S;
    if (id) fill_attr(id, &e->attr);
}

static uint64_t find(uint64_t dir, const char *name) {
    for (uint64_t c = nodes[dir].first; c; c = nodes[c].next)
        if (!strcmp(nodes[c].name, name)) return c;
    return 0;
}

static int make(uint64_t dir, const char *name, uint32_t mode, uint64_t *out) {
    if (!get(dir) || !S_ISDIR(nodes[dir].mode)) return ENOTDIR;
    if (strlen(name) > NAME_MAX_BYTES) return ENAMETOOLONG;
    if (find(dir, name)) return EEXIST;
    if (next_id >= NODES_MAX) return ENOSPC;
    uint64_t id = next_id++;
    struct node *n = &nodes[id];
    memset(n, 0, sizeof *n);
    n->used = 1, n->parent = dir, n->mode = mode, n->nlookup = 1;
    strcpy(n->name, name);
    clock_gettime(CLOCK_REALTIME, &n->mtime);
    n->ctime = n->mtime;
    n->next = nodes[dir].first;
    nodes[dir].first = id;
    nodes[dir].mtime = nodes[dir].ctime = n->mtime;
    *out = id;
    return 0;
}

static void drop(uint64_t id, uint64_t nlookup) {
    struct node *n = get(id);
    if (!n || id == FUSE_ROOT_ID) return;
    n->nlookup = nlookup > n->nlookup ? 0 : n->nlookup - nlookup;
    if (!n->nlookup && n->unlinked) free(n->data), n->used = 0;
}

static int remove_name(uint64_t dir, const char *name, int want_dir) {
    uint64_t id = get(dir) ? find(dir, name) : 0, *link = &nodes[dir].first;
    if (!id) return ENOENT;
    if (want_dir && !S_ISDIR(nodes[id].mode)) return ENOTDIR;
    if (!want_dir && S_ISDIR(nodes[id].mode)) return EISDIR;
    if (want_dir && nodes[id].first) return ENOTEMPTY;
    while (*link != id) link = &nodes[*link].next;
    *link = nodes[id].next;
    nodes[id].unlinked = 1;
    clock_gettime(CLOCK_REALTIME, &nodes[dir].mtime);
    nodes[dir].ctime = nodes[dir].mtime;
    drop(id, 0);
    return 0;
}

/* READDIR(PLUS): children in list order from index `off`; each entry's offset is its index + 1 */
static size_t list(uint64_t dir, uint64_t off, uint32_t size, int plus, char *out) {
    size_t used = 0;
    uint64_t i = 0;
    for (uint64_t c = nodes[dir].first; c; c = nodes[c].next, i++) {
        if (i < off) continue;
        size_t len = strlen(nodes[c].name), rec = FUSE_DIRENT_ALIGN((plus ? FUSE_NAME_OFFSET_DIRENTPLUS : FUSE_NAME_OFFSET) + len);
        if (used + rec > size) break;
        memset(out + used, 0, rec);
        struct fuse_dirent *d = (struct fuse_dirent *)(out + used);
        if (plus) {
            struct fuse_direntplus *p = (struct fuse_direntplus *)(out + used);
            fill_entry(c, &p->entry_out);
            nodes[c].nlookup++;
            d = &p->dirent;
        }
        d->ino = c, d->off = i + 1, d->namelen = len, d->type = (nodes[c].mode & S_IFMT) >> 12;
        memcpy(d->name, nodes[c].name, len);
        used += rec;
    }
    return used;
}

static void serve(int fd, struct fuse_in_header *h, char *arg) {
    union { struct fuse_entry_out e; struct fuse_attr_out a; struct fuse_init_out i; struct fuse_open_out o;
            struct fuse_write_out w; struct fuse_statfs_out s; } r;
    struct { struct fuse_entry_out e; struct fuse_open_out o; } created;
    struct node *n = get(h->nodeid);
    uint64_t id;
    int err;
    memset(&r, 0, sizeof r);
    counts[h->opcode < OPCODES_MAX ? h->opcode : 0]++;
    switch (h->opcode) {
    case FUSE_INIT: {
        struct fuse_init_in *in = (void *)arg;
        uint64_t offered = in->flags | (in->flags & FUSE_INIT_EXT ? (uint64_t)in->flags2 << 32 : 0);
        uint64_t wanted = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_MAX_PAGES | FUSE_DO_READDIRPLUS
                          | FUSE_READDIRPLUS_AUTO | FUSE_PARALLEL_DIROPS | FUSE_HANDLE_KILLPRIV_V2 | FUSE_INIT_EXT;
        uint64_t granted = wanted & offered; /* no ATOMIC_O_TRUNC: no-open mode, as ours */
        r.i.major = FUSE_KERNEL_VERSION, r.i.minor = FUSE_KERNEL_MINOR_VERSION;
        r.i.max_readahead = in->max_readahead, r.i.flags = granted, r.i.flags2 = granted >> 32;
        r.i.max_background = 64, r.i.congestion_threshold = 48;
        r.i.max_write = MAX_WRITE, r.i.time_gran = 1, r.i.max_pages = MAX_WRITE / 4096;
        return reply(fd, h->unique, 0, &r.i, sizeof r.i);
    }
    case FUSE_FORGET: return drop(h->nodeid, ((struct fuse_forget_in *)arg)->nlookup);
    case FUSE_BATCH_FORGET: {
        struct fuse_batch_forget_in *in = (void *)arg;
        struct fuse_forget_one *one = (void *)(in + 1);
        for (uint32_t k = 0; k < in->count && (char *)(one + k + 1) <= buf + h->len; k++)
            drop(one[k].nodeid, one[k].nlookup);
        return;
    }
    case FUSE_INTERRUPT: return;
    }
    if (!n) return reply(fd, h->unique, ESTALE, NULL, 0);
    switch (h->opcode) {
    case FUSE_LOOKUP:
        id = find(h->nodeid, arg);
        if (id) nodes[id].nlookup++;
        fill_entry(id, &r.e); /* a missing name: a negative entry for 60 s, as ours */
        return reply(fd, h->unique, 0, &r.e, sizeof r.e);
    case FUSE_SETATTR: {
        struct fuse_setattr_in *in = (void *)arg;
        if (in->valid & FATTR_SIZE) {
            if (in->size > FILE_BYTES_MAX) return reply(fd, h->unique, EFBIG, NULL, 0);
            if (!n->data) n->data = calloc(1, FILE_BYTES_MAX);
            if (in->size > n->size) memset(n->data + n->size, 0, in->size - n->size);
            n->size = in->size;
        }
        if (in->valid & FATTR_MODE) n->mode = (n->mode & S_IFMT) | (in->mode & 07777);
        if (in->valid & FATTR_MTIME) n->mtime.tv_sec = in->mtime, n->mtime.tv_nsec = in->mtimensec;
        clock_gettime(CLOCK_REALTIME, &n->ctime);
    } /* fall through */
    case FUSE_GETATTR:
        r.a.attr_valid = TIMEOUT_S;
        fill_attr(h->nodeid, &r.a.attr);
        return reply(fd, h->unique, 0, &r.a, sizeof r.a);
    case FUSE_MKDIR: case FUSE_CREATE: {
        int dir = h->opcode == FUSE_MKDIR;
        uint32_t mode = dir ? ((struct fuse_mkdir_in *)arg)->mode : ((struct fuse_create_in *)arg)->mode;
        const char *name = arg + (dir ? sizeof(struct fuse_mkdir_in) : sizeof(struct fuse_create_in));
        if ((err = make(h->nodeid, name, (dir ? S_IFDIR : S_IFREG) | (mode & 07777), &id)))
            return reply(fd, h->unique, err, NULL, 0);
        fill_entry(id, &created.e);
        created.o = (struct fuse_open_out){0, FOPEN_NOFLUSH | FOPEN_KEEP_CACHE, 0};
        return reply(fd, h->unique, 0, &created, dir ? sizeof created.e : sizeof created);
    }
    case FUSE_UNLINK: case FUSE_RMDIR:
        return reply(fd, h->unique, remove_name(h->nodeid, arg, h->opcode == FUSE_RMDIR), NULL, 0);
    case FUSE_OPENDIR:
        r.o.open_flags = 0;
        return reply(fd, h->unique, 0, &r.o, sizeof r.o);
    case FUSE_READ: {
        struct fuse_read_in *in = (void *)arg;
        uint64_t end = in->offset + in->size < n->size ? in->offset + in->size : n->size;
        return reply(fd, h->unique, 0, n->data + in->offset, in->offset < end ? end - in->offset : 0);
    }
    case FUSE_WRITE: {
        struct fuse_write_in *in = (void *)arg;
        if (in->offset > FILE_BYTES_MAX || in->size > FILE_BYTES_MAX - in->offset) /* no wrap-around */
            return reply(fd, h->unique, EFBIG, NULL, 0);
        if (sizeof *h + sizeof *in + in->size > h->len) return reply(fd, h->unique, EINVAL, NULL, 0);
        if (!n->data) n->data = calloc(1, FILE_BYTES_MAX);
        memcpy(n->data + in->offset, in + 1, in->size);
        if (in->offset + in->size > n->size) n->size = in->offset + in->size;
        clock_gettime(CLOCK_REALTIME, &n->mtime);
        n->ctime = n->mtime;
        r.w.size = in->size;
        return reply(fd, h->unique, 0, &r.w, sizeof r.w);
    }
    case FUSE_READDIR: case FUSE_READDIRPLUS: {
        struct fuse_read_in *in = (void *)arg;
        static char out[1 << 17];
        uint32_t size = in->size < sizeof out ? in->size : sizeof out;
        return reply(fd, h->unique, 0, out, list(h->nodeid, in->offset, size, h->opcode == FUSE_READDIRPLUS, out));
    }
    case FUSE_STATFS:
        r.s.st = (struct fuse_kstatfs){.blocks = 1 << 20, .bfree = 1 << 20, .bavail = 1 << 20, .files = NODES_MAX,
                                       .ffree = NODES_MAX - next_id, .bsize = 4096, .namelen = NAME_MAX_BYTES,
                                       .frsize = 4096};
        return reply(fd, h->unique, 0, &r.s, sizeof r.s);
    case FUSE_RELEASE: case FUSE_RELEASEDIR: case FUSE_DESTROY:
        return reply(fd, h->unique, 0, NULL, 0);
    case FUSE_GETXATTR: return reply(fd, h->unique, ENODATA, NULL, 0); /* as ours: no security.capability */
    default: return reply(fd, h->unique, ENOSYS, NULL, 0); /* OPEN, FLUSH (no-open, as ours) and the rest */
    }
}

int main(int argc, char **argv) {
    if (argc != 2) return fprintf(stderr, "usage: fuse_floor MOUNTPOINT\n"), 2;
    int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fd < 0) return perror("fuse_floor: /dev/fuse"), 1;
    char opts[128];
    snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other", fd);
    if (mount("fuse-floor", argv[1], "fuse", MS_NOSUID | MS_NODEV, opts)) return perror("fuse_floor: mount"), 1;
    nodes[FUSE_ROOT_ID] = (struct node){.used = 1, .nlookup = 1, .mode = S_IFDIR | 0755};
    clock_gettime(CLOCK_REALTIME, &nodes[FUSE_ROOT_ID].mtime);
    nodes[FUSE_ROOT_ID].ctime = nodes[FUSE_ROOT_ID].mtime;
    struct sigaction sa = {.sa_handler = on_usr1, .sa_flags = SA_RESTART};
    sigaction(SIGUSR1, &sa, NULL);
    printf("mounted\n");
    fflush(stdout);
    for (;;) {
        ssize_t got = read(fd, buf, sizeof buf);
        if (got < 0 && (errno == EINTR || errno == ENOENT || errno == EAGAIN)) continue;
        if (got < 0) return errno == ENODEV ? 0 : (perror("fuse_floor: read"), 1); /* ENODEV: unmounted */
        struct fuse_in_header *h = (void *)buf;
        if ((size_t)got < sizeof *h || h->len != (uint32_t)got) continue;
        buf[got < BUF_BYTES ? got : BUF_BYTES - 1] = 0; /* names end in NUL; a bound for a bad one */
        serve(fd, h, buf + sizeof *h);
        if (h->opcode == FUSE_DESTROY) return 0;
    }
}
