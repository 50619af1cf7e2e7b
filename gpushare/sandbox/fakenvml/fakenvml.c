/*
 * A stand-in for libnvidia-ml.so.1 that presents the GPUs of a described machine.
 *
 * It exports the NVML entry points gpushare's inventory reads through pynvml, with NVML's own
 * signatures, struct layouts and return codes, so the real Python binding runs end to end on a
 * machine without a GPU. Nothing here touches hardware.
 *
 * The machine is read at nvmlInit from the file named by $GPUSHARE_FAKE_NVML_MACHINE or, when that is
 * unset, from the description built in: FAKE_NVML_MACHINE (its text as a C string) and
 * FAKE_NVML_MACHINE_NAME, defined by a header given to gcc with -include. Either way it is one
 * "key value" per line, '#' starts a comment.
 *     driver loaded | not-loaded        not-loaded: nvmlInit answers NVML_ERROR_DRIVER_NOT_LOADED
 *     driver-version X.Y.Z              what nvmlSystemGetDriverVersion answers; absent: 550.54.15
 *     memory-limits present | absent    absent: a driver older than 615, without nvmlDeviceSetMemoryLimits_v1
 *                                       and nvmlDeviceGetMemoryLimits_v1. The library exports them unless
 *                                       compiled with -DFAKE_NVML_NO_MEMORY_LIMITS, and nvmlInit refuses
 *                                       (NVML_ERROR_UNKNOWN, said on stderr) a description that disagrees.
 *     memory-limits-backend dmem | misc which of the driver's two backends enforces the hard limits (see
 *                                       "Memory a process sees" below); absent: dmem
 *     gpu                               starts the next card, in NVML index order; then its keys:
 *       uuid, name, bus (NVML's 8-digit-domain PCI bus ID), memory-mib, minor
 *       reserved-mib N                  what the driver keeps of the card for itself (nvmlMemory_v2_t.reserved,
 *                                       "reserved for system use (driver or firmware)"); after memory-mib and
 *                                       not above it; absent: 0
 *       numa N                          absent: the memory-affinity query answers NOT_SUPPORTED
 *       mig enabled | disabled          absent: MIG queries answer NOT_SUPPORTED
 *       nvlink BUSID|switch [COUNT]     COUNT active links to that GPU or to the NVSwitch fabric;
 *                                       "nvlink unsupported": the card has no NVLink at all
 *       state lost                      the card is off the bus from the start
 *       fail CALL CODE                  CALL (the exported name, e.g. nvmlDeviceRegisterEvents) answers
 *                                       CODE for this card: not-supported, gpu-is-lost or unknown
 * Health is scripted through the file named by $GPUSHARE_FAKE_NVML_CONTROL: lines
 * appended to it are applied on the next NVML call, one command per line:
 *     xid <uuid> <n>     raise XID <n> on the card (an nvmlEventTypeXidCriticalError event)
 *     lose <uuid>        the card falls off the bus: its queries answer NVML_ERROR_GPU_IS_LOST
 *     restore <uuid>     the card answers again
 *
 * Per-container memory limits (nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1, driver 615+)
 * are kept per card and cgroup directory, as NVIDIA documents them
 * (https://docs.nvidia.com/deploy/nvml-api/api/structnvmlSetMemoryLimits__v1__t.html and
 * https://docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html). A limit is keyed by the nameSpace
 * path as given (no newline in it); paths are matched as normalised absolute paths (".", ".." and repeated
 * '/' taken out, a relative path joined to the working directory, symlinks not followed). As the driver
 * drops a cgroup's limits when the cgroup is removed, every call about a card (and every event wait) first
 * drops the limits whose directory no longer exists. Setting soft 0 / hard NVML_DEVICE_MEMORY_LIMIT_MAX
 * clears a limit; getting a cgroup without one answers exactly that, with currentUsed 0 (nothing runs on a
 * fake card).
 *
 * Reservations on the ancestors: a soft limit is a guarantee (dmem.min), which the driver backs by
 * reserving it on every ancestor too. Setting cgroup C's soft limit adds the change to a "held for
 * descendants" amount of every ancestor of C that is a cgroup (a directory holding cgroup.controllers)
 * below the cgroup2 mount point (the root cgroup itself excluded); clearing C's soft limit takes it back.
 * When C is removed with its soft limit still set, the ancestors keep holding it: the reservation drifts,
 * as NVIDIA warns it does. nvmlDeviceGetMemoryLimits_v1 on a cgroup answers softLimit = its own soft limit
 * + what it holds for its descendants, hardLimit = its own hard limit. Directories that are not cgroups
 * below the cgroup2 mount (a scratch folder's) have no ancestors in this sense.
 *
 * Memory a process sees: nvmlDeviceGetMemoryInfo and nvmlDeviceGetMemoryInfo_v2 answer for the calling
 * process's cgroup (the "0::" line of /proc/self/cgroup, under the cgroup2 mount point that
 * /proc/self/mountinfo shows, read at the first nvmlInit). The hard cap on that cgroup is, under the dmem
 * backend (the kernel's dmem controller, hierarchical), the smallest hard limit of the cgroup and its
 * ancestors; under misc (the driver's own backend, not documented as hierarchical), the cgroup's own hard
 * limit only. Under a cap: total = free = the cap, used = 0, v2 reserved = 0. Without one: total = memory-mib,
 * v2 reserved = reserved-mib, free = total - reserved, used = 0 in v2; v1 has no reserved field and counts
 * the reserved memory as used (nvmlMemory_t's used: "Sum of Reserved and Allocated device memory"), so v1
 * answers used = reserved-mib and the same free.
 *
 * When $GPUSHARE_FAKE_NVML_LIMITS names a file, the table of limits is recorded there after every change:
 * the file is rewritten (a temporary file renamed over it) with one line per card and cgroup that has a
 * limit or holds a reservation for its descendants, in the order the lines were first made:
 *     <uuid> <softLimit> <hardLimit> <held> <path>
 * softLimit and hardLimit are the cgroup's own (0 and NVML_DEVICE_MEMORY_LIMIT_MAX when it has none), held
 * what it holds for its descendants, all in bytes; path is as given to nvmlDeviceSetMemoryLimits_v1, or the
 * normalised path of an ancestor that only holds a reservation.
 * As the driver's limits are one table for the whole machine, the file is that table: every call that
 * takes the lock reads it back under an exclusive flock(2) of <file>.lock, and a change is written before
 * that lock is released, so every process using the record sees (and changes) the same limits, and they
 * outlive the process that set them. A process that kept its own copy would write back limits another
 * process had cleared since.
 * A limit dropped with its cgroup while its soft limit was still set (not cleared first) is appended,
 * under the same lock, to <file>.leaks as "<uuid> <softLimit> <path>": the soft limit is a guarantee
 * (dmem.min under the kernel's dmem controller), so a test can check that every one was released
 * before its cgroup went rather than left for the driver to drop (and on its ancestors, to drift).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;
typedef struct fake_event_set *nvmlEventSet_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_P2P_CAPS_INDEX_NVLINK 2
#define NVML_P2P_STATUS_OK 0
#define NVML_P2P_STATUS_NOT_SUPPORTED 5
#define NVML_AFFINITY_SCOPE_NODE 0
#define NVML_DEVICE_MIG_DISABLE 0
#define NVML_DEVICE_MIG_ENABLE 1
#define NVML_EVENT_TYPE_XID_CRITICAL 0x8ULL
#define NVML_DEVICE_MEMORY_LIMIT_MAX 0xFFFFFFFFFFFFFFFFULL

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

/* NVML_STRUCT_VERSION(Memory, 2): the struct's size and its version in the top byte (nvml.h) */
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2 << 24)))

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    const char *nameSpace; /* the cgroup directory */
    unsigned long long softLimit;
    unsigned long long hardLimit;
} nvmlSetMemoryLimits_v1_t;

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit;
    unsigned long long hardLimit;
    unsigned long long currentUsed;
} nvmlGetMemoryLimits_v1_t;

#define MAX_DEVICES 32
#define MAX_LINKS 18
#define MAX_QUEUE 64
#define MAX_FAILS 4

struct fake_device {
    char uuid[96];
    char name[96];
    char bus_id[32];
    unsigned long long memory_mib;
    unsigned long long reserved_mib;
    unsigned int minor;
    int numa;           /* -1: the memory-affinity query is not supported */
    int mig;            /* -1: MIG not supported, else NVML_DEVICE_MIG_* */
    int nvlink;         /* 0: the card has no NVLink (queries answer NOT_SUPPORTED) */
    int links;          /* active links */
    char link_peer[MAX_LINKS][32]; /* remote bus ID of each active link; "switch" for an NVSwitch */
    int lost;
    int fails;
    char fail_call[MAX_FAILS][64];
    nvmlReturn_t fail_code[MAX_FAILS];
};

struct fake_event_set {
    unsigned long long mask[MAX_DEVICES];
    nvmlEventData_t queue[MAX_QUEUE];
    int head, count;
    int lost_seen[MAX_DEVICES]; /* the set already answered GPU_IS_LOST for this card */
    struct fake_event_set *next;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_device devices[MAX_DEVICES];
static int device_count;
static int init_count;
static nvmlReturn_t init_error;
static char driver_version[80];
static int memory_limits; /* the description's memory-limits: 1 present, 0 absent */
static int misc_backend;  /* the description's memory-limits-backend: 1 misc, 0 dmem */
static struct fake_event_set *sets;
static FILE *control;
static char control_partial[256];

#ifdef FAKE_NVML_MACHINE
static const char builtin_machine[] = FAKE_NVML_MACHINE;
#endif

/* --- the machine description ---------------------------------------------------------------------- */

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    char *end = s + strlen(s);
    while (end > s && (end[-1] == '\n' || end[-1] == '\r' || end[-1] == ' ' || end[-1] == '\t')) *--end = 0;
    return s;
}

static void copy_field(char *dst, size_t size, const char *src) {
    snprintf(dst, size, "%s", src);
}

/* Reads the description from f, which it closes; name says where it came from in errors.
 * Returns 0, or a line number where the description is wrong (reported on stderr). */
static int parse_machine(FILE *f, const char *name) {
    char line[512];
    int lineno = 0, bad = 0;
    struct fake_device *d = NULL;
    device_count = 0;
    init_error = NVML_SUCCESS;
    copy_field(driver_version, sizeof driver_version, "550.54.15");
    memory_limits = 1;
    misc_backend = 0;
    while (!bad && fgets(line, sizeof line, f)) {
        lineno++;
        char *s = trim(line);
        if (*s == 0 || *s == '#') continue;
        char *value = s + strcspn(s, " \t");
        if (*value) *value++ = 0;
        value = trim(value);
        if (!strcmp(s, "driver")) {
            if (!strcmp(value, "not-loaded")) init_error = NVML_ERROR_DRIVER_NOT_LOADED;
            else if (strcmp(value, "loaded")) bad = lineno;
        } else if (!strcmp(s, "driver-version")) {
            if (!*value || strlen(value) >= sizeof driver_version || strspn(value, "0123456789.") != strlen(value))
                bad = lineno;
            else copy_field(driver_version, sizeof driver_version, value);
        } else if (!strcmp(s, "memory-limits")) {
            if (!strcmp(value, "absent")) memory_limits = 0;
            else if (!strcmp(value, "present")) memory_limits = 1;
            else bad = lineno;
        } else if (!strcmp(s, "memory-limits-backend")) {
            if (!strcmp(value, "misc")) misc_backend = 1;
            else if (!strcmp(value, "dmem")) misc_backend = 0;
            else bad = lineno;
        } else if (!strcmp(s, "gpu")) {
            if (device_count == MAX_DEVICES) { bad = lineno; break; }
            d = &devices[device_count++];
            memset(d, 0, sizeof *d);
            d->numa = -1;
            d->mig = -1;
            d->nvlink = 1;
        } else if (!d) {
            bad = lineno;
        } else if (!strcmp(s, "uuid")) {
            copy_field(d->uuid, sizeof d->uuid, value);
        } else if (!strcmp(s, "name")) {
            copy_field(d->name, sizeof d->name, value);
        } else if (!strcmp(s, "bus")) {
            copy_field(d->bus_id, sizeof d->bus_id, value);
        } else if (!strcmp(s, "memory-mib")) {
            d->memory_mib = strtoull(value, NULL, 10);
        } else if (!strcmp(s, "reserved-mib")) {
            d->reserved_mib = strtoull(value, NULL, 10);
            if (!*value || strspn(value, "0123456789") != strlen(value) || d->reserved_mib > d->memory_mib)
                bad = lineno;
        } else if (!strcmp(s, "minor")) {
            d->minor = (unsigned int)strtoul(value, NULL, 10);
        } else if (!strcmp(s, "numa")) {
            d->numa = atoi(value);
        } else if (!strcmp(s, "mig")) {
            d->mig = !strcmp(value, "enabled") ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
        } else if (!strcmp(s, "nvlink")) {
            char peer[32];
            int count = 1;
            if (!strcmp(value, "unsupported")) {
                d->nvlink = 0;
            } else if (sscanf(value, "%31s %d", peer, &count) < 1 || count < 1 || d->links + count > MAX_LINKS) {
                bad = lineno;
            } else {
                while (count--) copy_field(d->link_peer[d->links++], sizeof d->link_peer[0], peer);
            }
        } else if (!strcmp(s, "fail")) {
            char call[64], code[32];
            nvmlReturn_t ret = NVML_ERROR_UNKNOWN;
            if (sscanf(value, "%63s %31s", call, code) != 2 || d->fails == MAX_FAILS) bad = lineno;
            else if (!strcmp(code, "not-supported")) ret = NVML_ERROR_NOT_SUPPORTED;
            else if (!strcmp(code, "gpu-is-lost")) ret = NVML_ERROR_GPU_IS_LOST;
            else if (strcmp(code, "unknown")) bad = lineno;
            if (!bad) {
                copy_field(d->fail_call[d->fails], sizeof d->fail_call[0], call);
                d->fail_code[d->fails++] = ret;
            }
        } else if (!strcmp(s, "state")) {
            d->lost = !strcmp(value, "lost");
        } else {
            bad = lineno;
        }
    }
    fclose(f);
    if (bad) fprintf(stderr, "fake NVML: %s line %d is not understood\n", name, bad);
    return bad;
}

/* The file named by $GPUSHARE_FAKE_NVML_MACHINE, else the description built in. Returns as parse_machine,
 * or -1 when there is no description to read (reported on stderr). */
static int load_machine(void) {
    const char *path = getenv("GPUSHARE_FAKE_NVML_MACHINE");
    if (path) {
        FILE *f = fopen(path, "r");
        if (f) return parse_machine(f, path);
        fprintf(stderr, "fake NVML: cannot open machine description %s\n", path);
        return -1;
    }
#ifdef FAKE_NVML_MACHINE
    FILE *f = fmemopen((void *)builtin_machine, sizeof builtin_machine - 1, "r");
    if (f) return parse_machine(f, "built-in machine description " FAKE_NVML_MACHINE_NAME);
    fprintf(stderr, "fake NVML: cannot read the built-in machine description " FAKE_NVML_MACHINE_NAME "\n");
#else
    fprintf(stderr, "fake NVML: no machine: GPUSHARE_FAKE_NVML_MACHINE is unset and none is built in\n");
#endif
    return -1;
}

/* --- scripted health -------------------------------------------------------------------------------- */

static struct fake_device *by_uuid(const char *uuid) {
    for (int i = 0; i < device_count; i++)
        if (!strcmp(devices[i].uuid, uuid)) return &devices[i];
    return NULL;
}

static void raise_xid(struct fake_device *d, unsigned long long xid) {
    int i = (int)(d - devices);
    for (struct fake_event_set *s = sets; s; s = s->next) {
        if (!(s->mask[i] & NVML_EVENT_TYPE_XID_CRITICAL) || s->count == MAX_QUEUE) continue;
        nvmlEventData_t *e = &s->queue[(s->head + s->count++) % MAX_QUEUE];
        memset(e, 0, sizeof *e);
        e->device = d;
        e->eventType = NVML_EVENT_TYPE_XID_CRITICAL;
        e->eventData = xid;
    }
}

static void apply(char *line) {
    char verb[16], uuid[96];
    unsigned long long xid = 0;
    int n = sscanf(line, "%15s %95s %llu", verb, uuid, &xid);
    struct fake_device *d = n >= 2 ? by_uuid(uuid) : NULL;
    if (!d) {
        fprintf(stderr, "fake NVML: control line ignored: %s\n", line);
    } else if (!strcmp(verb, "xid") && n == 3) {
        raise_xid(d, xid);
    } else if (!strcmp(verb, "lose")) {
        d->lost = 1;
        for (struct fake_event_set *s = sets; s; s = s->next) s->lost_seen[d - devices] = 0;
    } else if (!strcmp(verb, "restore")) {
        d->lost = 0;
    } else {
        fprintf(stderr, "fake NVML: control line ignored: %s\n", line);
    }
}

/* Apply the control lines appended since the last call. Called with the lock held. */
static void poll_control(void) {
    if (!control) return;
    char chunk[256];
    clearerr(control);
    while (fgets(chunk, sizeof chunk, control)) {
        strncat(control_partial, chunk, sizeof control_partial - strlen(control_partial) - 1);
        size_t len = strlen(control_partial);
        if (len == 0 || control_partial[len - 1] != '\n') continue; /* the writer is mid-line */
        apply(trim(control_partial));
        control_partial[0] = 0;
    }
}

/* --- memory limits ---------------------------------------------------------------------------------- */

#ifdef FAKE_NVML_NO_MEMORY_LIMITS
#define HAS_MEMORY_LIMITS 0
#else
#define HAS_MEMORY_LIMITS 1
#define MAX_LIMITS 256

#define PATH_SIZE 1024

struct limit {
    int device;                    /* index into devices */
    unsigned long long soft, hard; /* the cgroup's own */
    unsigned long long held;       /* what it holds for its descendants' soft limits */
    char path[PATH_SIZE];          /* as given, or an ancestor's normalised path */
    char key[PATH_SIZE];           /* path, normalised: what cgroups are matched by */
};

/* The live limits, in the order first set, and a scratch table that a change is made in before it is
 * recorded: a change that can't be recorded is not made. */
static struct limit limits[MAX_LIMITS], next_limits[MAX_LIMITS];
static int limit_count;
static char record_path[1024];
static int record_lock = -1; /* <record_path>.lock, open from the first nvmlInit to the last nvmlShutdown */
static int record_held;      /* this call holds record_lock (and the table was read under it) */
static char cgroup_root[PATH_SIZE]; /* the cgroup2 mount point, normalised; "" when there is none */

/* path as an absolute path without ".", ".." or repeated '/' (a relative path joined to the working
 * directory; symlinks are not followed), in out (size bytes). Returns 0, or -1 when it doesn't fit. */
static int normalise(const char *path, char *out, size_t size) {
    char joined[2 * PATH_SIZE + 2], *save = NULL;
    size_t len = 0;
    if (path[0] == '/') {
        copy_field(joined, sizeof joined, path);
    } else {
        char cwd[PATH_SIZE];
        if (!getcwd(cwd, sizeof cwd)) return -1;
        snprintf(joined, sizeof joined, "%s/%s", cwd, path);
    }
    for (char *part = strtok_r(joined, "/", &save); part; part = strtok_r(NULL, "/", &save)) {
        size_t n = strlen(part);
        if (!strcmp(part, ".")) continue;
        if (!strcmp(part, "..")) {
            while (len && out[--len] != '/') {
            }
            continue;
        }
        if (len + 1 + n >= size) return -1;
        out[len++] = '/';
        memcpy(out + len, part, n);
        len += n;
    }
    if (len == 0) out[len++] = '/';
    out[len] = 0;
    return 0;
}

static int is_directory(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Rewrite the record file with the table, atomically. Returns 0, or -1 (reported on stderr). */
static int write_record(const struct limit *table, int count) {
    if (!record_path[0]) return 0;
    char partial[sizeof record_path + 8];
    snprintf(partial, sizeof partial, "%s.XXXXXX", record_path);
    int fd = mkstemp(partial);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "w");
    int ok = f != NULL && fchmod(fd, 0644) == 0;
    for (int i = 0; ok && i < count; i++)
        ok = fprintf(f, "%s %llu %llu %llu %s\n", devices[table[i].device].uuid, table[i].soft, table[i].hard,
                     table[i].held, table[i].path) > 0;
    if (f && fclose(f) != 0) ok = 0;
    else if (!f && fd >= 0) close(fd);
    if (ok && rename(partial, record_path) == 0) return 0;
    fprintf(stderr, "fake NVML: cannot record the memory limits in %s\n", record_path);
    if (fd >= 0) unlink(partial);
    return -1;
}

/* Make next_limits (count entries) the live table, once it is recorded. */
static int commit_limits(int count) {
    if (write_record(next_limits, count) != 0) return -1;
    memcpy(limits, next_limits, (size_t)count * sizeof *limits);
    limit_count = count;
    return 0;
}

/* Note the soft limits of the cgroups that are gone, in <record_path>.leaks. Called with the lock held. */
static void record_leaks(void) {
    if (!record_path[0]) return;
    char leaks_path[sizeof record_path + 8];
    snprintf(leaks_path, sizeof leaks_path, "%s.leaks", record_path);
    FILE *f = NULL;
    for (int i = 0; i < limit_count; i++) {
        if (limits[i].soft == 0 || is_directory(limits[i].path)) continue;
        if (!f && !(f = fopen(leaks_path, "a"))) {
            fprintf(stderr, "fake NVML: cannot record a leaked soft limit in %s\n", leaks_path);
            return;
        }
        fprintf(f, "%s %llu %s\n", devices[limits[i].device].uuid, limits[i].soft, limits[i].path);
    }
    if (f) fclose(f);
}

/* Drop the limits of cgroups that are gone, as the driver does. Called with the lock held. */
static void prune_limits(void) {
    int kept = 0;
    for (int i = 0; i < limit_count; i++)
        if (is_directory(limits[i].path)) next_limits[kept++] = limits[i];
    if (kept == limit_count) return;
    record_leaks();
    if (commit_limits(kept) != 0) { /* the cgroups are gone all the same */
        memcpy(limits, next_limits, (size_t)kept * sizeof *limits);
        limit_count = kept;
    }
}

/* At the first nvmlInit: where the limits are recorded, and the lock that guards the record. Returns 0, or -1
 * when the record file's name is too long or its lock can't be opened (reported on stderr). */
static int open_record(void) {
    const char *path = getenv("GPUSHARE_FAKE_NVML_LIMITS");
    limit_count = 0;
    if (path && strlen(path) >= sizeof record_path) {
        fprintf(stderr, "fake NVML: the memory-limit record file's name is too long: %s\n", path);
        return -1;
    }
    copy_field(record_path, sizeof record_path, path ? path : "");
    if (!record_path[0]) return 0;
    char lock_path[sizeof record_path + 8];
    snprintf(lock_path, sizeof lock_path, "%s.lock", record_path);
    record_lock = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (record_lock >= 0) return 0;
    fprintf(stderr, "fake NVML: cannot open the memory-limit record's lock %s\n", lock_path);
    return -1;
}

/* Read the record into the live table, the lock held: the limits as every process last left them. */
static void read_record(void) {
    limit_count = 0;
    FILE *f = fopen(record_path, "r");
    if (!f) return;
    char line[PATH_SIZE + 256], uuid[96];
    int offset;
    while (fgets(line, sizeof line, f)) {
        struct limit *l = &limits[limit_count];
        struct fake_device *d;
        char *s = trim(line);
        if (!*s) continue;
        if (limit_count == MAX_LIMITS ||
            sscanf(s, "%95s %llu %llu %llu %n", uuid, &l->soft, &l->hard, &l->held, &offset) != 4 ||
            !(d = by_uuid(uuid)) || !s[offset] || strlen(s + offset) >= sizeof l->path ||
            normalise(s + offset, l->key, sizeof l->key) != 0) {
            fprintf(stderr, "fake NVML: %s: memory limit ignored: %s\n", record_path, s);
            continue;
        }
        l->device = (int)(d - devices);
        copy_field(l->path, sizeof l->path, s + offset);
        limit_count++;
    }
    fclose(f);
}

/* Take the record's lock for this call and read the limits under it. Called with the mutex held. */
static void hold_record(void) {
    if (record_lock < 0 || record_held) return;
    while (flock(record_lock, LOCK_EX) != 0 && errno == EINTR) {
    }
    record_held = 1;
    read_record();
}

/* Let other processes at the record again, once this call's change (if any) is written. */
static void release_record(void) {
    if (!record_held) return;
    flock(record_lock, LOCK_UN);
    record_held = 0;
}

/* The line of table (count lines) about the card and the cgroup whose normalised path is key, or -1. */
static int find_limit(const struct limit *table, int count, int device, const char *key) {
    for (int i = 0; i < count; i++)
        if (table[i].device == device && !strcmp(table[i].key, key)) return i;
    return -1;
}

/* Adds the change of a cgroup's soft limit, from old_soft to new_soft, to what each of its ancestors (key:
 * its normalised path) holds for it in next_limits (*count lines, a line made for an ancestor without one).
 * Returns NVML_SUCCESS, or NVML_ERROR_INSUFFICIENT_RESOURCES when the table is full. */
static nvmlReturn_t hold_on_ancestors(int device, const char *key, unsigned long long old_soft,
                                      unsigned long long new_soft, int *count) {
    size_t root = strlen(cgroup_root);
    if (!root || strncmp(key, cgroup_root, root) || (key[root] != '/' && root > 1))
        return NVML_SUCCESS; /* not below the cgroup2 mount point */
    char ancestor[PATH_SIZE], controllers[PATH_SIZE + 32];
    copy_field(ancestor, sizeof ancestor, key);
    for (char *slash; (slash = strrchr(ancestor, '/')) && (size_t)(slash - ancestor) > root;) {
        *slash = 0;
        snprintf(controllers, sizeof controllers, "%s/cgroup.controllers", ancestor);
        if (access(controllers, F_OK) != 0) continue; /* not a cgroup */
        int at = find_limit(next_limits, *count, device, ancestor);
        if (at < 0) {
            if (*count == MAX_LIMITS) return NVML_ERROR_INSUFFICIENT_RESOURCES;
            at = (*count)++;
            struct limit *l = &next_limits[at];
            l->device = device;
            l->soft = l->held = 0;
            l->hard = NVML_DEVICE_MEMORY_LIMIT_MAX;
            copy_field(l->path, sizeof l->path, ancestor);
            copy_field(l->key, sizeof l->key, ancestor);
        }
        unsigned long long *held = &next_limits[at].held;
        if (new_soft >= old_soft) *held += new_soft - old_soft;
        else *held -= old_soft - new_soft < *held ? old_soft - new_soft : *held;
    }
    return NVML_SUCCESS;
}

/* Drop the lines of next_limits (count lines) with neither a limit nor a reservation; returns how many are
 * left. */
static int drop_empty(int count) {
    int kept = 0;
    for (int i = 0; i < count; i++)
        if (next_limits[i].soft || next_limits[i].hard != NVML_DEVICE_MEMORY_LIMIT_MAX || next_limits[i].held)
            next_limits[kept++] = next_limits[i];
    return kept;
}

/* The hard cap on a process in the cgroup whose normalised path is key, on the card (see the header). */
static unsigned long long hard_cap(int device, const char *key) {
    unsigned long long cap = NVML_DEVICE_MEMORY_LIMIT_MAX;
    char cgroup[PATH_SIZE];
    copy_field(cgroup, sizeof cgroup, key);
    size_t root = strlen(cgroup_root);
    for (;;) {
        int at = find_limit(limits, limit_count, device, cgroup);
        if (at >= 0 && limits[at].hard < cap) cap = limits[at].hard;
        char *slash = strrchr(cgroup, '/');
        if (misc_backend || !slash || (size_t)(slash - cgroup) < root) return cap;
        *slash = 0;
    }
}

/* mountinfo's octal escapes (\040 for a space) taken out of s, in place. */
static void unescape(char *s) {
    char *out = s;
    for (; *s; s++) {
        unsigned int c;
        if (*s == '\\' && sscanf(s + 1, "%3o", &c) == 1 && strspn(s + 1, "01234567") >= 3) {
            *out++ = (char)c;
            s += 3;
        } else {
            *out++ = *s;
        }
    }
    *out = 0;
}

/* At the first nvmlInit: the first cgroup2 mount point in /proc/self/mountinfo, as gpushare finds it. */
static void find_cgroup_root(void) {
    cgroup_root[0] = 0;
    FILE *f = fopen("/proc/self/mountinfo", "r");
    if (!f) return;
    char line[4 * PATH_SIZE], mount[PATH_SIZE];
    while (!cgroup_root[0] && fgets(line, sizeof line, f)) {
        /* ID PARENT MAJOR:MINOR ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER-OPTIONS */
        const char *dash = strstr(line, " - ");
        if (!dash || strncmp(dash + 3, "cgroup2 ", 8) || sscanf(line, "%*s %*s %*s %*s %1023s", mount) != 1)
            continue;
        unescape(mount);
        if (normalise(mount, cgroup_root, sizeof cgroup_root) != 0) cgroup_root[0] = 0;
    }
    fclose(f);
}

/* The calling process's cgroup directory, normalised, in out (PATH_SIZE); 0, or -1 when it has none under
 * the cgroup2 mount point. */
static int own_cgroup(char *out) {
    if (!cgroup_root[0]) return -1;
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f) return -1;
    char line[PATH_SIZE], joined[2 * PATH_SIZE];
    int found = -1;
    while (found && fgets(line, sizeof line, f)) {
        if (strncmp(line, "0::/", 4)) continue;
        snprintf(joined, sizeof joined, "%s/%s", cgroup_root, trim(line + 4));
        found = normalise(joined, out, PATH_SIZE);
    }
    fclose(f);
    return found;
}
#endif

/* Every NVML call that takes the lock starts here: apply the scripted health, drop stale limits. */
static void poll_state(void) {
    poll_control();
#if HAS_MEMORY_LIMITS
    hold_record();
    prune_limits();
#endif
}

/* --- init ------------------------------------------------------------------------------------------ */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&lock);
    if (init_count == 0) {
        if (load_machine() != 0) {
            ret = NVML_ERROR_UNKNOWN;
        } else if (memory_limits != HAS_MEMORY_LIMITS) {
            fprintf(stderr, "fake NVML: %s\n",
                    HAS_MEMORY_LIMITS ? "the machine says memory-limits absent but this library exports them"
                                      : "the machine has memory limits but this library was built without them");
            ret = NVML_ERROR_UNKNOWN;
        } else if (init_error != NVML_SUCCESS) {
            ret = init_error;
#if HAS_MEMORY_LIMITS
        } else if (open_record() != 0) {
            ret = NVML_ERROR_UNKNOWN;
#endif
        } else {
#if HAS_MEMORY_LIMITS
            find_cgroup_root();
#endif
            const char *path = getenv("GPUSHARE_FAKE_NVML_CONTROL");
            control = path ? fopen(path, "r") : NULL;
            if (control) fseek(control, 0, SEEK_END); /* only what is written from now on */
            control_partial[0] = 0;
        }
    }
    if (ret == NVML_SUCCESS) init_count++;
    pthread_mutex_unlock(&lock);
    return ret;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = init_count ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (init_count && --init_count == 0) {
        if (control) fclose(control);
        control = NULL;
#if HAS_MEMORY_LIMITS
        if (record_lock >= 0) close(record_lock);
        record_lock = -1;
#endif
        while (sets) {
            struct fake_event_set *next = sets->next;
            free(sets);
            sets = next;
        }
    }
    pthread_mutex_unlock(&lock);
    return ret;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* --- devices --------------------------------------------------------------------------------------- */

/* Every device query starts here: initialised, a known handle, the card still on the bus, and the
 * call not one the description makes fail. Takes the lock; leave() releases it. */
static nvmlReturn_t enter_call(nvmlDevice_t device, const char *call) {
    pthread_mutex_lock(&lock);
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    poll_state();
    if (device < devices || device >= devices + device_count) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->lost) return NVML_ERROR_GPU_IS_LOST;
    for (int i = 0; i < device->fails; i++)
        if (!strcmp(device->fail_call[i], call)) return device->fail_code[i];
    return NVML_SUCCESS;
}

#define enter(device) enter_call(device, __func__)

/* The end of every call that took the lock: the record's lock first, then the mutex. */
static void release(void) {
#if HAS_MEMORY_LIMITS
    release_record();
#endif
    pthread_mutex_unlock(&lock);
}

static nvmlReturn_t leave(nvmlReturn_t ret) {
    release();
    return ret;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    pthread_mutex_lock(&lock);
    if (!init_count) return leave(NVML_ERROR_UNINITIALIZED);
    if (!count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned int)device_count;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    pthread_mutex_lock(&lock);
    if (!init_count) return leave(NVML_ERROR_UNINITIALIZED);
    poll_state();
    if (!device || index >= (unsigned int)device_count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (devices[index].lost) return leave(NVML_ERROR_GPU_IS_LOST);
    *device = &devices[index];
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    pthread_mutex_lock(&lock);
    if (!init_count) return leave(NVML_ERROR_UNINITIALIZED);
    poll_state();
    if (!uuid || !device) return leave(NVML_ERROR_INVALID_ARGUMENT);
    struct fake_device *d = by_uuid(uuid);
    if (!d) return leave(NVML_ERROR_NOT_FOUND);
    if (d->lost) return leave(NVML_ERROR_GPU_IS_LOST);
    *device = d;
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t copy_out(const char *value, char *out, unsigned int length) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    pthread_mutex_lock(&lock);
    if (!init_count) return leave(NVML_ERROR_UNINITIALIZED);
    return leave(copy_out(driver_version, version, length));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    nvmlReturn_t ret = enter(device);
    return leave(ret != NVML_SUCCESS ? ret : copy_out(device->uuid, uuid, length));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    nvmlReturn_t ret = enter(device);
    return leave(ret != NVML_SUCCESS ? ret : copy_out(device->name, name, length));
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!index) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)(device - devices);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!minor) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *minor = device->minor;
    return leave(NVML_SUCCESS);
}

/* What the driver tells the calling process of the card's memory: the hard cap on its cgroup with nothing
 * reserved, or without a cap the card and what the driver keeps of it (see the header). Called inside
 * enter/leave. */
static void memory_seen(nvmlDevice_t device, unsigned long long *total, unsigned long long *reserved) {
    unsigned long long cap = NVML_DEVICE_MEMORY_LIMIT_MAX;
#if HAS_MEMORY_LIMITS
    char cgroup[PATH_SIZE];
    if (own_cgroup(cgroup) == 0) cap = hard_cap((int)(device - devices), cgroup);
#endif
    int capped = cap != NVML_DEVICE_MEMORY_LIMIT_MAX;
    *total = capped ? cap : device->memory_mib * 1024ULL * 1024ULL;
    *reserved = capped ? 0 : device->reserved_mib * 1024ULL * 1024ULL;
}

/* v1 has no reserved field: it counts what the driver reserves as used ("Sum of Reserved and Allocated
 * device memory", https://docs.nvidia.com/deploy/nvml-api/api/structnvmlMemory__t.html). */
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    memory_seen(device, &memory->total, &memory->used);
    memory->free = memory->total - memory->used;
    return leave(NVML_SUCCESS);
}

/* https://docs.nvidia.com/deploy/nvml-api/api/structnvmlMemory__v2__t.html: reserved is apart, used is only
 * what is allocated (nothing, on a fake card); the R525 reference still said used included reserved. */
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory_seen(device, &memory->total, &memory->reserved);
    memory->free = memory->total - memory->reserved;
    memory->used = 0;
    return leave(NVML_SUCCESS);
}

static void fill_pci(const char *bus_id, nvmlPciInfo_t *pci) {
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", bus_id);
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04x:%02x:%02x.%x", domain & 0xffff, bus, dev, fn);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = 0x20b010de;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!pci) return leave(NVML_ERROR_INVALID_ARGUMENT);
    fill_pci(device->bus_id, pci);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

/* nodeSet is unsigned long[] in NVML's header: 64 NUMA nodes per element on Linux. */
nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize, unsigned long *nodeSet,
                                         unsigned int scope) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!nodeSet || nodeSetSize == 0 || scope > 1) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (device->numa < 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    unsigned int word = (unsigned int)device->numa / 64;
    if (word < nodeSetSize) nodeSet[word] = 1UL << (device->numa % 64);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!currentMode || !pendingMode) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (device->mig < 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = *pendingMode = (unsigned int)device->mig;
    return leave(NVML_SUCCESS);
}

#if HAS_MEMORY_LIMITS
/* What both memory-limit calls check of the card and the cgroup they name, whose normalised path they get
 * in key (PATH_SIZE). Called inside enter/leave. */
static nvmlReturn_t check_limit_target(nvmlDevice_t device, const void *request, const char *path, char *key) {
    if (!request || !path || strlen(path) >= PATH_SIZE || strchr(path, '\n') || normalise(path, key, PATH_SIZE))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device->mig == NVML_DEVICE_MIG_ENABLE) return NVML_ERROR_NOT_SUPPORTED;
    return is_directory(path) ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limit) {
    char key[PATH_SIZE];
    nvmlReturn_t ret = enter(device);
    if (ret == NVML_SUCCESS) ret = check_limit_target(device, limit, limit ? limit->nameSpace : NULL, key);
    if (ret != NVML_SUCCESS) return leave(ret);
    unsigned long long memory = device->memory_mib * 1024ULL * 1024ULL;
    int too_large = limit->hardLimit > memory && limit->hardLimit != NVML_DEVICE_MEMORY_LIMIT_MAX;
    if (limit->softLimit > limit->hardLimit || too_large) return leave(NVML_ERROR_INVALID_ARGUMENT);
    int clear = limit->softLimit == 0 && limit->hardLimit == NVML_DEVICE_MEMORY_LIMIT_MAX;
    int card = (int)(device - devices), count = limit_count, at = find_limit(limits, count, card, key);
    if (at < 0 && clear) return leave(NVML_SUCCESS);
    if (at < 0 && count == MAX_LIMITS) return leave(NVML_ERROR_INSUFFICIENT_RESOURCES);
    memcpy(next_limits, limits, (size_t)count * sizeof *limits);
    if (at < 0) {
        struct limit *l = &next_limits[at = count++];
        l->device = card;
        l->soft = l->held = 0;
        l->hard = NVML_DEVICE_MEMORY_LIMIT_MAX;
        copy_field(l->path, sizeof l->path, limit->nameSpace);
        copy_field(l->key, sizeof l->key, key);
    }
    unsigned long long old_soft = next_limits[at].soft;
    next_limits[at].soft = limit->softLimit;
    next_limits[at].hard = limit->hardLimit;
    ret = hold_on_ancestors(card, key, old_soft, limit->softLimit, &count);
    if (ret != NVML_SUCCESS) return leave(ret);
    return leave(commit_limits(drop_empty(count)) == 0 ? NVML_SUCCESS : NVML_ERROR_UNKNOWN);
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limit) {
    char key[PATH_SIZE];
    nvmlReturn_t ret = enter(device);
    if (ret == NVML_SUCCESS) ret = check_limit_target(device, limit, limit ? limit->nameSpace : NULL, key);
    if (ret != NVML_SUCCESS) return leave(ret);
    int at = find_limit(limits, limit_count, (int)(device - devices), key);
    limit->softLimit = at < 0 ? 0 : limits[at].soft + limits[at].held;
    limit->hardLimit = at < 0 ? NVML_DEVICE_MEMORY_LIMIT_MAX : limits[at].hard;
    limit->currentUsed = 0;
    return leave(NVML_SUCCESS);
}
#endif

static int on_switch(const struct fake_device *d) {
    for (int i = 0; i < d->links; i++)
        if (!strcmp(d->link_peer[i], "switch")) return 1;
    return 0;
}

static int linked(const struct fake_device *a, const struct fake_device *b) {
    for (int i = 0; i < a->links; i++)
        if (!strcasecmp(a->link_peer[i], b->bus_id)) return 1;
    return 0;
}

/* NVLink reachability: a direct link either way, or both cards on the NVSwitch fabric. */
nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, unsigned int p2pIndex,
                                    unsigned int *p2pStatus) {
    nvmlReturn_t ret = enter(device1);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (device2 < devices || device2 >= devices + device_count || !p2pStatus || p2pIndex > 6)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (device2->lost) return leave(NVML_ERROR_GPU_IS_LOST);
    if (p2pIndex != NVML_P2P_CAPS_INDEX_NVLINK) {
        *p2pStatus = NVML_P2P_STATUS_OK; /* PCIe peer access: every card here allows it */
        return leave(NVML_SUCCESS);
    }
    if (!device1->nvlink || !device2->nvlink) return leave(NVML_ERROR_NOT_SUPPORTED);
    int ok = device1 != device2 &&
             (linked(device1, device2) || linked(device2, device1) || (on_switch(device1) && on_switch(device2)));
    *p2pStatus = ok ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    return leave(NVML_SUCCESS);
}

/* --- events ---------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    pthread_mutex_lock(&lock);
    if (!init_count) return leave(NVML_ERROR_UNINITIALIZED);
    if (!set) return leave(NVML_ERROR_INVALID_ARGUMENT);
    struct fake_event_set *s = calloc(1, sizeof *s);
    if (!s) return leave(NVML_ERROR_UNKNOWN);
    s->next = sets;
    sets = s;
    *set = s;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!eventTypes) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = NVML_EVENT_TYPE_XID_CRITICAL;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    nvmlReturn_t ret = enter(device);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!set) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~NVML_EVENT_TYPE_XID_CRITICAL) return leave(NVML_ERROR_NOT_SUPPORTED);
    set->mask[device - devices] |= eventTypes;
    return leave(NVML_SUCCESS);
}

/* Wait for an event on the set. A registered card that falls off the bus makes the wait answer
 * NVML_ERROR_GPU_IS_LOST once, as the driver does, without saying which card it was. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    struct timespec start, now, pause = {0, 5 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&lock);
        if (!init_count) return leave(NVML_ERROR_UNINITIALIZED);
        if (!set || !data) return leave(NVML_ERROR_INVALID_ARGUMENT);
        poll_state();
        for (int i = 0; i < device_count; i++) {
            if (set->mask[i] && devices[i].lost && !set->lost_seen[i]) {
                set->lost_seen[i] = 1;
                return leave(NVML_ERROR_GPU_IS_LOST);
            }
        }
        if (set->count) {
            *data = set->queue[set->head];
            set->head = (set->head + 1) % MAX_QUEUE;
            set->count--;
            return leave(NVML_SUCCESS);
        }
        release();
        clock_gettime(CLOCK_MONOTONIC, &now);
        long waited = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (waited >= (long)timeoutms) return NVML_ERROR_TIMEOUT;
        nanosleep(&pause, NULL);
    }
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    pthread_mutex_lock(&lock);
    if (!init_count) return leave(NVML_ERROR_UNINITIALIZED);
    for (struct fake_event_set **p = &sets; *p; p = &(*p)->next) {
        if (*p == set) {
            *p = set->next;
            free(set);
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_INVALID_ARGUMENT);
}
