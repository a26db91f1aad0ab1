/*
 * cilia-cni: the static CNI executable the container runtime execs on the host.
 *
 * It carries one CNI invocation (the CNI_* environment, the network configuration on stdin
 * and the name it was exec'd as) to the CNI server (`cilia-cni serve`, the plugin logic in
 * Python, a long-running process beside cilia-agent) over a unix socket, and writes the
 * server's answer (stdout text and exit status) back. It links no libc dynamically
 * (`cc -static`), so it runs on any Linux host whatever its glibc (or none).
 *
 * Where the server listens: `cilia-cni.sock` in the directory of the netconf's
 * `agent-socket` (default /var/run/cilia/cilia.sock, so /var/run/cilia/cilia-cni.sock).
 *
 * When the server cannot be reached (socket missing or refusing, or it closed before a
 * whole answer), the executable answers itself, as the Python plugin does when the agent
 * is unreachable:
 *   VERSION  the supported versions (in the requested cniVersion when spoken, else 1.1.0);
 *   DEL      queued on disk in the agent's format (QueuedDel, see services/cni/README.md)
 *            and successful: the agent replays the queue when it starts;
 *   STATUS   code 50; everything else code 11.
 *
 * Wire format of one call (integers are 4-byte big-endian unsigned):
 *   request  "CCN1", count, count x (len, "NAME=VALUE" of each CNI_* variable),
 *            len, plugin type (basename of argv[0]), stdin state (0 read, 1 a directory,
 *            2 unreadable: errno follows as one more integer), len, stdin bytes
 *   answer   exit status, len, stdout bytes
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>

extern char **environ;

/* Largest netconf read from stdin (the Python plugin's MAX_STDIN_BYTES, 16 MiB); one byte
 * more is read so the server sees "too large". */
#define MAX_STDIN_BYTES (16u * 1024u * 1024u)
/* Largest answer accepted from the server (a result is a few KiB). */
#define MAX_ANSWER_BYTES (64u * 1024u * 1024u)
/* How long the executable waits for the server's answer, seconds: above the largest
 * netconf deadline (agent-timeout-seconds <= 240) plus the rollback. */
#define ANSWER_TIMEOUT_SECONDS 600
#define DEFAULT_AGENT_SOCKET "/var/run/cilia/cilia.sock"
#define SERVER_SOCKET_NAME "cilia-cni.sock"
#define DEFAULT_DEL_QUEUE_DIR "/var/run/cilia/del-queue"
#define DEFAULT_DEL_QUEUE_MAX 256
#define NEWEST_VERSION "1.1.0"

static const char *const SUPPORTED[] = {"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"};

/* ------------------------------------------------------------------ growing buffer */
struct buf { unsigned char *p; size_t n, cap; };

static int buf_put(struct buf *b, const void *data, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p; b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
    return 0;
}

static int buf_u32(struct buf *b, uint32_t v) {
    unsigned char x[4] = {v >> 24, v >> 16, v >> 8, v};
    return buf_put(b, x, 4);
}

static int buf_str(struct buf *b, const void *s, size_t n) {
    return buf_u32(b, (uint32_t)n) || buf_put(b, s, n);
}

/* ------------------------------------------------------------------ output */
static int write_all(int fd, const void *data, size_t n) {
    const char *p = data;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) { if (errno == EINTR) continue; return -1; }
        p += w; n -= (size_t)w;
    }
    return 0;
}

/* JSON string literal of s (ASCII control characters escaped; other bytes as they are). */
static void json_str(struct buf *b, const char *s) {
    buf_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') { buf_put(b, "\\", 1); buf_put(b, s, 1); }
        else if (c < 0x20) { char e[8]; snprintf(e, sizeof e, "\\u%04x", c); buf_put(b, e, 6); }
        else buf_put(b, s, 1);
    }
    buf_put(b, "\"", 1);
}

static int emit(int status, struct buf *out) {
    if (write_all(1, out->p, out->n) != 0) return 1; /* not delivered: never success */
    return status;
}

static int cni_error(const char *version, int code, const char *msg, const char *details) {
    struct buf b = {0};
    char num[16];
    buf_put(&b, "{\"cniVersion\": ", 15);
    json_str(&b, version);
    snprintf(num, sizeof num, "%d", code);
    buf_put(&b, ", \"code\": ", 10); buf_put(&b, num, strlen(num));
    buf_put(&b, ", \"msg\": ", 9); json_str(&b, msg);
    buf_put(&b, ", \"details\": ", 13); json_str(&b, details);
    buf_put(&b, "}\n", 2);
    return emit(1, &b);
}

/* ------------------------------------------------------------------ a JSON reader
 * Validates a whole JSON text (RFC 8259) and picks a few top-level string/number members.
 */
struct conf {
    char *cni_version, *agent_socket, *queue_dir;
    long long queue_max; int has_queue_max;
};
struct js { const unsigned char *p, *end; int depth; };

static void ws(struct js *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int hex4(const unsigned char *p, unsigned *v) {
    *v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return -1;
        *v = *v * 16 + d;
    }
    return 0;
}

/* A string at j->p ('"'); when out is set, its value (UTF-8; NULL when it holds \u0000 or a
 * lone surrogate) is stored there (malloc'd). */
static int jstring(struct js *j, char **out) {
    struct buf b = {0};
    int ok_value = 1;
    j->p++;
    for (;;) {
        if (j->p >= j->end) return -1;
        unsigned char c = *j->p++;
        if (c == '"') break;
        if (c < 0x20) return -1;
        if (c != '\\') { buf_put(&b, &c, 1); continue; }
        if (j->p >= j->end) return -1;
        c = *j->p++;
        const char *simple = strchr("\"\\/bfnrt", c);
        if (c && simple) {
            static const char map[] = "\"\\/\b\f\n\r\t";
            buf_put(&b, &map[simple - "\"\\/bfnrt"], 1);
            continue;
        }
        if (c != 'u' || j->end - j->p < 4) return -1;
        unsigned u;
        if (hex4(j->p, &u)) return -1;
        j->p += 4;
        if (u >= 0xd800 && u < 0xdc00 && j->end - j->p >= 6 && j->p[0] == '\\' && j->p[1] == 'u') {
            unsigned lo;
            if (hex4(j->p + 2, &lo)) return -1;
            if (lo >= 0xdc00 && lo < 0xe000) { j->p += 6; u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00); }
        }
        unsigned char e[4]; size_t n;
        if (u == 0 || (u >= 0xd800 && u < 0xe000)) { ok_value = 0; continue; }
        if (u < 0x80) { e[0] = u; n = 1; }
        else if (u < 0x800) { e[0] = 0xc0 | u >> 6; e[1] = 0x80 | (u & 63); n = 2; }
        else if (u < 0x10000) { e[0] = 0xe0 | u >> 12; e[1] = 0x80 | ((u >> 6) & 63); e[2] = 0x80 | (u & 63); n = 3; }
        else { e[0] = 0xf0 | u >> 18; e[1] = 0x80 | ((u >> 12) & 63); e[2] = 0x80 | ((u >> 6) & 63); e[3] = 0x80 | (u & 63); n = 4; }
        buf_put(&b, e, n);
    }
    if (out) {
        if (ok_value) { buf_put(&b, "", 1); *out = (char *)b.p; b.p = NULL; }
        else *out = NULL;
    }
    free(b.p);
    return 0;
}

static int jvalue(struct js *j, struct conf *top, const char *key);

static int jnumber(struct js *j, long long *iv, int *is_int) {
    const unsigned char *s = j->p;
    int integer = 1;
    if (j->p < j->end && *j->p == '-') j->p++;
    if (j->p >= j->end) return -1;
    if (*j->p == '0') j->p++;
    else if (*j->p >= '1' && *j->p <= '9') while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    else return -1;
    if (j->p < j->end && *j->p == '.') {
        integer = 0; j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9') return -1;
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        integer = 0; j->p++;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-')) j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9') return -1;
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    }
    if (iv) {
        char tmp[32];
        size_t n = (size_t)(j->p - s);
        *is_int = integer && n < sizeof tmp;
        if (*is_int) { memcpy(tmp, s, n); tmp[n] = 0; *iv = strtoll(tmp, NULL, 10); }
    }
    return 0;
}

static int jobject(struct js *j, struct conf *top) {
    j->p++;
    ws(j);
    if (j->p < j->end && *j->p == '}') { j->p++; return 0; }
    for (;;) {
        char *key = NULL;
        ws(j);
        if (j->p >= j->end || *j->p != '"' || jstring(j, &key)) { free(key); return -1; }
        ws(j);
        if (j->p >= j->end || *j->p++ != ':') { free(key); return -1; }
        ws(j);
        int rc = jvalue(j, top, key);
        free(key);
        if (rc) return -1;
        ws(j);
        if (j->p >= j->end) return -1;
        if (*j->p == '}') { j->p++; return 0; }
        if (*j->p++ != ',') return -1;
    }
}

static int jarray(struct js *j) {
    j->p++;
    ws(j);
    if (j->p < j->end && *j->p == ']') { j->p++; return 0; }
    for (;;) {
        ws(j);
        if (jvalue(j, NULL, NULL)) return -1;
        ws(j);
        if (j->p >= j->end) return -1;
        if (*j->p == ']') { j->p++; return 0; }
        if (*j->p++ != ',') return -1;
    }
}

/* A value; when top is set and key names a member we read, it is stored. */
static int jvalue(struct js *j, struct conf *top, const char *key) {
    if (j->p >= j->end || ++j->depth > 512) return -1;
    int rc = 0;
    char **slot = NULL;
    if (top && key) {
        if (!strcmp(key, "cniVersion")) slot = &top->cni_version;
        else if (!strcmp(key, "agent-socket")) slot = &top->agent_socket;
        else if (!strcmp(key, "del-queue-dir")) slot = &top->queue_dir;
    }
    switch (*j->p) {
    case '{': rc = jobject(j, NULL); break;
    case '[': rc = jarray(j); break;
    case '"':
        if (slot) { free(*slot); *slot = NULL; }
        rc = jstring(j, slot);
        break;
    case 't': rc = (j->end - j->p >= 4 && !memcmp(j->p, "true", 4)) ? (j->p += 4, 0) : -1; break;
    case 'f': rc = (j->end - j->p >= 5 && !memcmp(j->p, "false", 5)) ? (j->p += 5, 0) : -1; break;
    case 'n': rc = (j->end - j->p >= 4 && !memcmp(j->p, "null", 4)) ? (j->p += 4, 0) : -1; break;
    default:
        if (top && key && !strcmp(key, "del-queue-max")) {
            int is_int = 0;
            rc = jnumber(j, &top->queue_max, &is_int);
            top->has_queue_max = is_int;
        } else rc = jnumber(j, NULL, NULL);
    }
    j->depth--;
    return rc;
}

/* 0: a JSON object, its members read into c; -1: not JSON or not an object. */
static int parse_conf(const unsigned char *data, size_t n, struct conf *c) {
    struct js j = {data, data + n, 0};
    ws(&j);
    if (j.p >= j.end || *j.p != '{') return -1;
    if (jobject(&j, c)) return -1;
    ws(&j);
    return j.p == j.end ? 0 : -1;
}

static const char *spoken(const char *v) {
    for (size_t i = 0; v && i < sizeof SUPPORTED / sizeof *SUPPORTED; i++)
        if (!strcmp(v, SUPPORTED[i])) return SUPPORTED[i];
    return NULL;
}

/* ------------------------------------------------------------------ SHA-256 (FIPS 180-4) */
static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(uint32_t h[8], const unsigned char *p) {
    uint32_t w[64], a, b, c, d, e, f, g, k;
    for (int i = 0; i < 16; i++) w[i] = (uint32_t)p[4 * i] << 24 | p[4 * i + 1] << 16 | p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = h[0]; b = h[1]; c = h[2]; d = h[3]; e = h[4]; f = h[5]; g = h[6]; k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

static void sha256_hex16(const unsigned char *data, size_t n, char out[17]) {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    unsigned char tail[128] = {0};
    size_t full = n / 64 * 64, rest = n - full;
    for (size_t i = 0; i < full; i += 64) sha256_block(h, data + i);
    memcpy(tail, data + full, rest);
    tail[rest] = 0x80;
    size_t tl = rest + 9 <= 64 ? 64 : 128;
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++) tail[tl - 1 - i] = (unsigned char)(bits >> (8 * i));
    sha256_block(h, tail);
    if (tl == 128) sha256_block(h, tail + 64);
    for (int i = 0; i < 8; i++) snprintf(out + 2 * i, 3, "%02x", (h[i / 4] >> (24 - 8 * (i % 4))) & 0xff);
    out[16] = 0;
}

/* ------------------------------------------------------------------ the DEL queue */
static void pb_varint(struct buf *b, uint64_t v) {
    unsigned char c;
    do { c = v & 0x7f; v >>= 7; if (v) c |= 0x80; buf_put(b, &c, 1); } while (v);
}

static void pb_string(struct buf *b, int field, const char *s) {
    size_t n = strlen(s);
    if (!n) return; /* proto3: the default is not written */
    pb_varint(b, (uint64_t)field << 3 | 2);
    pb_varint(b, n);
    buf_put(b, s, n);
}

static int mkdirs(const char *path, mode_t mode) {
    char tmp[4096];
    if (strlen(path) >= sizeof tmp) { errno = ENAMETOOLONG; return -1; }
    strcpy(tmp, path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, mode) && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(tmp, mode) && errno != EEXIST) return -1;
    return 0;
}

/* Queue the DEL (one file per attachment, as the Python plugin writes it); 0 on success. */
static int queue_del(const char *version, const struct conf *c, const char *why) {
    const char *cid = getenv("CNI_CONTAINERID"), *ifname = getenv("CNI_IFNAME");
    const char *netns = getenv("CNI_NETNS");
    const char *dir = c->queue_dir ? c->queue_dir : DEFAULT_DEL_QUEUE_DIR;
    long long limit = c->has_queue_max ? c->queue_max : DEFAULT_DEL_QUEUE_MAX;
    char msg[8192], key[17], name[64], path[4352], tmp[4352];
    if (!cid || !*cid) return cni_error(version, 4, "CNI_CONTAINERID is not set", "");
    if (!ifname || !*ifname) return cni_error(version, 4, "CNI_IFNAME is not set", "");
    if (dir[0] != '/' || strlen(dir) > 4000)
        return cni_error(version, 7, "netconf `del-queue-dir` must be an absolute path", dir);
    if (limit < 1 || limit > 65536)
        return cni_error(version, 7, "netconf `del-queue-max` must be an integer in 1..65536", "");
    size_t kn = strlen(cid) + 1 + strlen(ifname);
    char *keysrc = malloc(kn + 1);
    if (!keysrc) return cni_error(version, 999, "out of memory", "");
    snprintf(keysrc, kn + 1, "%s/%s", cid, ifname);
    sha256_hex16((const unsigned char *)keysrc, kn, key);
    free(keysrc);
    if (mkdirs(dir, 0700)) {
        snprintf(msg, sizeof msg, "cilia-cni server is unreachable (%s) and the DEL queue directory %s is unusable (%s): fix the netconf field `del-queue-dir` or start cilia-agent; the runtime will retry", why, dir, strerror(errno));
        return cni_error(version, 11, msg, strerror(errno));
    }
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(msg, sizeof msg, "cilia-cni server is unreachable (%s) and the DEL queue directory %s is unreadable (%s); the runtime will retry", why, dir, strerror(errno));
        return cni_error(version, 11, msg, strerror(errno));
    }
    long long count = 0;
    char suffix[32];
    snprintf(suffix, sizeof suffix, "-%s.del", key);
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 4 || strcmp(e->d_name + n - 4, ".del")) continue;
        if (n >= strlen(suffix) && !strcmp(e->d_name + n - strlen(suffix), suffix)) { closedir(d); return 0; }
        count++;
    }
    closedir(d);
    if (count >= limit) {
        snprintf(msg, sizeof msg, "cilia-cni server is unreachable (%s) and its DEL queue %s is full (%lld of %lld, netconf `del-queue-max`): start cilia-agent so it replays the queue; the runtime will retry", why, dir, count, limit);
        return cni_error(version, 11, msg, "");
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long now_ms = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    snprintf(name, sizeof name, "%013lld-%s.del", now_ms, key);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s/.%s.%d.tmp", dir, name, (int)getpid());
    struct buf req = {0}, file = {0};
    pb_string(&req, 1, cid);
    pb_string(&req, 2, ifname);
    pb_string(&req, 3, netns ? netns : "");
    pb_varint(&file, 1 << 3 | 2);
    pb_varint(&file, req.n);
    buf_put(&file, req.p, req.n);
    pb_varint(&file, 2 << 3 | 0);
    pb_varint(&file, (uint64_t)now_ms);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int ok = fd >= 0 && write_all(fd, file.p, file.n) == 0 && fsync(fd) == 0;
    int err = errno;
    if (fd >= 0) close(fd);
    if (ok && rename(tmp, path) == 0) return 0;
    err = errno ? errno : err;
    unlink(tmp);
    snprintf(msg, sizeof msg, "cilia-cni server is unreachable (%s) and the DEL could not be queued in %s (%s): the runtime will retry", why, dir, strerror(err));
    return cni_error(version, 11, msg, strerror(err));
}

/* ------------------------------------------------------------------ the server call */
static int read_all(int fd, void *data, size_t n) {
    char *p = data;
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0) { if (errno == EINTR) continue; return -1; }
        if (r == 0) return -1;
        p += r; n -= (size_t)r;
    }
    return 0;
}

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3];
}

int main(int argc, char **argv) {
    (void)argc;
    const char *command = getenv("CNI_COMMAND");
    const char *type = argv[0] && *argv[0] ? argv[0] : "cilia-cni";
    const char *slash = strrchr(type, '/');
    if (slash) type = slash + 1;

    /* stdin: at most one byte more than the limit */
    struct buf in = {0};
    uint32_t stdin_state = 0, stdin_errno = 0;
    struct stat st;
    if (fstat(0, &st) != 0) { stdin_state = 2; stdin_errno = (uint32_t)errno; }
    else if (S_ISDIR(st.st_mode)) stdin_state = 1;
    else {
        unsigned char chunk[65536];
        while (in.n <= MAX_STDIN_BYTES) {
            size_t want = MAX_STDIN_BYTES + 1 - in.n;
            ssize_t r = read(0, chunk, want < sizeof chunk ? want : sizeof chunk);
            if (r < 0) { if (errno == EINTR) continue; stdin_state = 2; stdin_errno = (uint32_t)errno; break; }
            if (r == 0) break;
            if (buf_put(&in, chunk, (size_t)r)) return cni_error(NEWEST_VERSION, 999, "out of memory", "");
        }
    }

    struct conf c = {0};
    int conf_ok = stdin_state == 0 && in.n <= MAX_STDIN_BYTES && parse_conf(in.p ? in.p : (const unsigned char *)"", in.n, &c) == 0;
    const char *version = conf_ok && spoken(c.cni_version) ? c.cni_version : NEWEST_VERSION;

    char sockpath[sizeof(((struct sockaddr_un *)0)->sun_path) + 64];
    const char *agent = conf_ok && c.agent_socket && c.agent_socket[0] == '/' ? c.agent_socket : DEFAULT_AGENT_SOCKET;
    const char *last = strrchr(agent, '/');
    snprintf(sockpath, sizeof sockpath, "%.*s/%s", (int)(last - agent), agent, SERVER_SOCKET_NAME);

    /* the request */
    struct buf req = {0};
    uint32_t count = 0;
    for (char **e = environ; *e; e++) if (!strncmp(*e, "CNI_", 4)) count++;
    buf_put(&req, "CCN1", 4);
    buf_u32(&req, count);
    for (char **e = environ; *e; e++) if (!strncmp(*e, "CNI_", 4)) buf_str(&req, *e, strlen(*e));
    buf_str(&req, type, strlen(type));
    buf_u32(&req, stdin_state);
    if (stdin_state == 2) buf_u32(&req, stdin_errno);
    buf_str(&req, in.p, in.n);

    const char *why = NULL;
    char whybuf[512];
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(sockpath) >= sizeof sa.sun_path) { why = "socket path too long"; }
    else {
        strcpy(sa.sun_path, sockpath);
        struct timeval tv = {.tv_sec = ANSWER_TIMEOUT_SECONDS};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
            snprintf(whybuf, sizeof whybuf, "%s: %s", sockpath, strerror(errno));
            why = whybuf;
        }
    }
    if (!why) {
        unsigned char head[8];
        if (write_all(fd, req.p, req.n) != 0 || (shutdown(fd, SHUT_WR), read_all(fd, head, 8)) != 0) {
            snprintf(whybuf, sizeof whybuf, "%s: closed before answering (%s)", sockpath, errno ? strerror(errno) : "end of stream");
            why = whybuf;
        } else {
            uint32_t status = be32(head), n = be32(head + 4);
            if (n > MAX_ANSWER_BYTES) return cni_error(version, 999, "cilia-cni server answered more than 64 MiB", sockpath);
            struct buf out = {malloc(n ? n : 1), n, n};
            if (!out.p) return cni_error(version, 999, "out of memory", "");
            if (n && read_all(fd, out.p, n) != 0) {
                /* the server went away mid-answer: an ADD may have happened, say so */
                snprintf(whybuf, sizeof whybuf, "cilia-cni server closed the connection mid-answer (%s)", sockpath);
                return cni_error(version, 11, whybuf, "");
            }
            return emit(status > 255 ? 1 : (int)status, &out);
        }
    }

    /* The server is unreachable: answer what needs no agent. */
    if (!command || !*command)
        return cni_error(version, 4, "CNI_COMMAND is not set", "set CNI_COMMAND to ADD, DEL, CHECK, GC, STATUS or VERSION");
    if (stdin_state == 1) return cni_error(version, 5, "cannot read the network configuration from stdin: stdin is a directory", "");
    if (stdin_state == 2) return cni_error(version, 5, "cannot read the network configuration from stdin", strerror((int)stdin_errno));
    if (!strcmp(command, "VERSION")) {
        int empty = 1;
        for (size_t i = 0; i < in.n; i++) if (!strchr(" \t\r\n", in.p[i])) empty = 0;
        if (!empty && !conf_ok) return cni_error(NEWEST_VERSION, 6, "cannot decode the network configuration on stdin", "not a JSON object");
        struct buf out = {0};
        buf_put(&out, "{\"cniVersion\": ", 15);
        json_str(&out, version);
        buf_put(&out, ", \"supportedVersions\": [", 24);
        for (size_t i = 0; i < sizeof SUPPORTED / sizeof *SUPPORTED; i++) {
            if (i) buf_put(&out, ", ", 2);
            json_str(&out, SUPPORTED[i]);
        }
        buf_put(&out, "]}\n", 3);
        return emit(0, &out);
    }
    if (!conf_ok) return cni_error(version, 6, "cannot decode the network configuration on stdin", "not a JSON object");
    if (!strcmp(command, "DEL")) return queue_del(version, &c, why);
    char msg[1024];
    snprintf(msg, sizeof msg, "cilia-cni server is unreachable (%s): is cilia-agent running on this node?", why);
    return cni_error(version, !strcmp(command, "STATUS") ? 50 : 11, msg, why);
}
