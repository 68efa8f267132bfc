/* Shared by the fuzz targets whose parsers read files (config.json, safetensors, tokenizer.json):
 * each process writes its inputs into one private folder, made once, under $TMPDIR (/dev/shm
 * when it exists, so no input touches a disk). Header-only: each target is one file. */
#ifndef MOESERVE_FUZZ_FILES_H
#define MOESERVE_FUZZ_FILES_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FUZZ_MAX_FILES 8

static char fuzz_dir_path[256];
static const char *fuzz_names[FUZZ_MAX_FILES]; /* every name written, removed at exit */

static inline void fuzz_cleanup(void) {
    char path[512];
    for (int i = 0; i < FUZZ_MAX_FILES && fuzz_names[i]; i++) {
        snprintf(path, sizeof path, "%s/%s", fuzz_dir_path, fuzz_names[i]);
        unlink(path);
    }
    rmdir(fuzz_dir_path);
}

/* The process's folder (made on first use; aborts when it cannot be). */
static inline const char *fuzz_dir(void) {
    char *dir = fuzz_dir_path;
    if (dir[0]) return dir;
    const char *base = getenv("TMPDIR");
    if (!base || !*base) base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(dir, sizeof fuzz_dir_path, "%s/moeserve-fuzz-XXXXXX", base);
    if (!mkdtemp(dir)) {
        perror("fuzz: mkdtemp");
        abort();
    }
    atexit(fuzz_cleanup);
    return dir;
}

/* The path of name inside the folder (a static buffer per call site is enough for the targets). */
static inline void fuzz_path(char *out, size_t n, const char *name) {
    snprintf(out, n, "%s/%s", fuzz_dir(), name);
}

/* Write len bytes as name (a string literal); len < 0 removes the file instead. */
static inline void fuzz_write(const char *name, const void *data, long len) {
    char path[512];
    fuzz_path(path, sizeof path, name);
    for (int i = 0; i < FUZZ_MAX_FILES; i++) {
        if (fuzz_names[i] && strcmp(fuzz_names[i], name)) continue;
        fuzz_names[i] = name;
        break;
    }
    if (len < 0) {
        unlink(path);
        return;
    }
    FILE *f = fopen(path, "wb");
    if (!f || (len > 0 && fwrite(data, 1, (size_t)len, f) != (size_t)len)) {
        perror("fuzz: write");
        abort();
    }
    fclose(f);
}

/* The index of the first NUL in data[0, len), or len: the targets that take several files split
 * their input at NUL bytes (no JSON text holds one). */
static inline size_t fuzz_split(const unsigned char *data, size_t len) {
    const unsigned char *z = memchr(data, 0, len);
    return z ? (size_t)(z - data) : len;
}

#endif
