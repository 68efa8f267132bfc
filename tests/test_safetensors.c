/* Checkpoint reader tests: good single-file and sharded checkpoints, then one broken checkpoint
 * per validation rule, each expected to fail with a message naming the file and the offending
 * field or tensor. Every checkpoint is written here, into a fresh temporary folder. */
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/tensor.h"
#include "config/safetensors.h"
#include "tests/check.h"

static char tmp_root[] = "/tmp/moeserve_test_safetensors_XXXXXX";

/* A fresh sub-folder of the temp root; returns a static buffer. */
static const char *new_dir(const char *name) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmp_root, name);
    if (mkdir(path, 0700) != 0) {
        perror(path);
        exit(2);
    }
    return path;
}

static void write_bytes(const char *path, const void *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n || fclose(f) != 0) {
        perror(path);
        exit(2);
    }
}

/* Write a safetensors file: 8-byte little-endian length, the header JSON (padded with spaces to a
 * multiple of 8 when pad is set, as the reference writer does), then data_len bytes of data. */
static void write_st(const char *path, const char *header, const void *data, size_t data_len,
                     bool pad) {
    size_t n = strlen(header);
    size_t padded = pad ? (n + 7) / 8 * 8 : n;
    size_t total = 8 + padded + data_len;
    unsigned char *buf = malloc(total);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, header, n);
    memset(buf + 8 + n, ' ', padded - n);
    if (data_len) memcpy(buf + 8 + padded, data, data_len);
    write_bytes(path, buf, total);
    free(buf);
}

static char *join(const char *dir, const char *name) {
    static char bufs[4][512];
    static int next;
    char *p = bufs[next++ % 4];
    snprintf(p, 512, "%s/%s", dir, name);
    return p;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    return remove(path);
}

/* rc is -1, the checkpoint is left empty, and the message holds both strings. */
#define EXPECT_FAIL(rc, ck, err, s1, s2)                                                           \
    do {                                                                                           \
        CHECK((rc) == -1, "expected failure, got %d", (rc));                                       \
        CHECK((ck).n_tensors == 0 && (ck).n_files == 0 && (ck).tensors == NULL,                    \
              "failed open left state behind");                                                    \
        CHECK(strstr((err), (s1)) != NULL, "message lacks \"%s\": %s", (s1), (err));               \
        CHECK(strstr((err), (s2)) != NULL, "message lacks \"%s\": %s", (s2), (err));               \
        checkpoint_close(&(ck));                                                                   \
    } while (0)

/* BF16 [2,3], F32 [2], F32 0-d, F32 [0] (empty), U8 [3]. */
static const char good_header[] =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"a.bf16\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
    "\"b.f32\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]},"
    "\"scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[20,24]},"
    "\"empty\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[24,24]},"
    "\"u8\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[24,27]}}";

static size_t good_data(unsigned char *d) {
    uint16_t a[6];
    for (int i = 0; i < 6; i++)
        a[i] = f32_to_bf16((float)i - 2.5f);
    float b[2] = {1.25f, -3.0f}, s = 42.0f;
    memcpy(d, a, 12);
    memcpy(d + 12, b, 8);
    memcpy(d + 20, &s, 4);
    d[24] = 7, d[25] = 8, d[26] = 9;
    return 27;
}

static void check_good_tensors(const checkpoint *ck, const char *path) {
    CHECK(ck->n_tensors == 5, "n_tensors %d", ck->n_tensors);
    for (int i = 1; i < ck->n_tensors; i++)
        CHECK(strcmp(ck->tensors[i - 1].name, ck->tensors[i].name) < 0, "not sorted at %d", i);

    const checkpoint_tensor *a = checkpoint_find(ck, "a.bf16");
    CHECK(a != NULL, "a.bf16 missing");
    if (a) {
        CHECK(a->t.dtype == DTYPE_BF16 && a->t.ndim == 2 && a->t.shape[0] == 2 &&
                  a->t.shape[1] == 3,
              "a.bf16 dtype/shape");
        CHECK(a->t.device == DEVICE_CPU, "device");
        CHECK(strcmp(a->file, path) == 0, "file %s", a->file);
        for (int i = 0; i < 6; i++)
            CHECK(tensor_get_f32(&a->t, i) == (float)i - 2.5f, "a.bf16[%d] = %g", i,
                  tensor_get_f32(&a->t, i));
    }
    const checkpoint_tensor *b = checkpoint_find(ck, "b.f32");
    CHECK(b && b->t.dtype == DTYPE_F32 && b->t.ndim == 1 && b->t.shape[0] == 2, "b.f32");
    if (b) {
        CHECK((uintptr_t)b->t.data % 4 == 0, "b.f32 data not aligned");
        CHECK(tensor_get_f32(&b->t, 0) == 1.25f && tensor_get_f32(&b->t, 1) == -3.0f,
              "b.f32 values");
    }
    const checkpoint_tensor *s = checkpoint_find(ck, "scalar");
    CHECK(s && s->t.ndim == 0 && tensor_numel(&s->t) == 1 && tensor_nbytes(&s->t) == 4, "0-d");
    if (s) {
        CHECK((uintptr_t)s->t.data % 4 == 0, "scalar data not aligned");
        CHECK(tensor_get_f32(&s->t, 0) == 42.0f, "scalar value");
    }
    const checkpoint_tensor *e = checkpoint_find(ck, "empty");
    CHECK(e && e->t.ndim == 1 && e->t.shape[0] == 0 && tensor_nbytes(&e->t) == 0, "empty");
    const checkpoint_tensor *u = checkpoint_find(ck, "u8");
    CHECK(u && u->t.dtype == DTYPE_U8 && ((const uint8_t *)u->t.data)[2] == 9, "u8");
    CHECK(checkpoint_find(ck, "__metadata__") == NULL, "__metadata__ is not a tensor");
    CHECK(checkpoint_find(ck, "missing") == NULL, "find missing");
    CHECK(checkpoint_find(ck, "") == NULL, "find empty name");
}

static void test_good_single(void) {
    const char *dir = new_dir("good");
    unsigned char data[64];
    size_t n = good_data(data);
    char *path = join(dir, "model.safetensors");
    write_st(path, good_header, data, n, true);

    char err[512] = "";
    checkpoint ck;
    int rc = checkpoint_open_file(&ck, path, err, sizeof err);
    CHECK(rc == 0, "open_file: %s", err);
    if (rc == 0) {
        CHECK(ck.n_files == 1 && strcmp(ck.file_paths[0], path) == 0, "files");
        check_good_tensors(&ck, path);
    }
    checkpoint_close(&ck);
    CHECK(ck.n_tensors == 0 && ck.tensors == NULL, "close clears");
    checkpoint_close(&ck); /* a second close is harmless */

    /* The same folder through checkpoint_open (no index: every *.safetensors). */
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    CHECK(rc == 0, "open dir: %s", err);
    if (rc == 0) check_good_tensors(&ck, path);
    checkpoint_close(&ck);
}

/* A header not padded to 8 bytes leaves F32 data at an odd address in the mapping; the reader
 * must still hand out aligned data with the right values. */
static void test_unpadded_header(void) {
    const char *dir = new_dir("unpadded");
    const char *header = "{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}";
    CHECK(strlen(header) % 4 != 0, "header length should misalign the data");
    float x[3] = {1.0f, 2.0f, -0.5f};
    char *path = join(dir, "model.safetensors");
    write_st(path, header, x, sizeof x, false);
    char err[512] = "";
    checkpoint ck;
    int rc = checkpoint_open_file(&ck, path, err, sizeof err);
    CHECK(rc == 0, "open: %s", err);
    const checkpoint_tensor *t = rc == 0 ? checkpoint_find(&ck, "x") : NULL;
    CHECK(t != NULL, "x missing");
    if (t) {
        CHECK((uintptr_t)t->t.data % 4 == 0, "data not aligned");
        for (int i = 0; i < 3; i++)
            CHECK(tensor_get_f32(&t->t, i) == x[i], "x[%d]", i);
    }
    checkpoint_close(&ck);
}

static void write_shards(const char *dir) {
    float x[4] = {1, 2, 3, 4}, y[2] = {5, 6};
    unsigned char d1[24];
    memcpy(d1, x, 16);
    memcpy(d1 + 16, y, 8);
    write_st(join(dir, "model-00001-of-00002.safetensors"),
             "{\"x\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
             "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}",
             d1, sizeof d1, true);
    uint16_t z[3] = {f32_to_bf16(7), f32_to_bf16(8), f32_to_bf16(9)};
    unsigned char d2[8] = {0};
    memcpy(d2, z, 6);
    d2[6] = 1;
    write_st(join(dir, "model-00002-of-00002.safetensors"),
             "{\"z\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[0,6]},"
             "\"extra\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[6,7]}}",
             d2, sizeof d2, true);
}

static void test_good_sharded(void) {
    const char *dir = new_dir("sharded");
    write_shards(dir);
    const char *index = "{\"metadata\":{\"total_size\":30},\"weight_map\":{"
                        "\"x\":\"model-00001-of-00002.safetensors\","
                        "\"z\":\"model-00002-of-00002.safetensors\","
                        "\"y\":\"model-00001-of-00002.safetensors\"}}";
    write_bytes(join(dir, "model.safetensors.index.json"), index, strlen(index));
    /* Not in the index, so not part of the checkpoint (it would not even parse). */
    write_bytes(join(dir, "stray.safetensors"), "garbage!garbage!", 16);

    char err[512] = "";
    checkpoint ck;
    int rc = checkpoint_open(&ck, dir, err, sizeof err);
    CHECK(rc == 0, "open sharded: %s", err);
    if (rc != 0) return;
    CHECK(ck.n_files == 2, "n_files %d", ck.n_files);
    CHECK(ck.n_tensors == 4, "n_tensors %d (extra, in a file but not the map, is kept)",
          ck.n_tensors);
    const checkpoint_tensor *x = checkpoint_find(&ck, "x"), *z = checkpoint_find(&ck, "z");
    const checkpoint_tensor *extra = checkpoint_find(&ck, "extra");
    CHECK(x && strstr(x->file, "model-00001-of-00002.safetensors"), "x file");
    CHECK(z && strstr(z->file, "model-00002-of-00002.safetensors"), "z file");
    CHECK(extra && extra->t.dtype == DTYPE_BOOL && ((const uint8_t *)extra->t.data)[0] == 1,
          "extra");
    if (x) CHECK(tensor_get_f32(&x->t, 3) == 4.0f, "x[3]");
    if (z) CHECK(tensor_get_f32(&z->t, 2) == 9.0f, "z[2]");
    checkpoint_close(&ck);

    /* Without the index the same two shards load as well (the stray file moved away). */
    const char *dir2 = new_dir("sharded_noindex");
    write_shards(dir2);
    rc = checkpoint_open(&ck, dir2, err, sizeof err);
    CHECK(rc == 0 && ck.n_files == 2 && ck.n_tensors == 4, "open without index: %s", err);
    checkpoint_close(&ck);
}

/* One bad file in its own folder, opened through checkpoint_open_file. */
static void expect_bad_file(const char *name, const char *header, const void *data, size_t n,
                            const char *want) {
    const char *dir = new_dir(name);
    char *path = join(dir, "model.safetensors");
    write_st(path, header, data, n, true);
    char err[512] = "";
    checkpoint ck;
    int rc = checkpoint_open_file(&ck, path, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, path, want);
}

static void test_bad_files(void) {
    unsigned char zeros[64] = {0};

    /* Truncated: the header promises 12 bytes, the file stops after 6. */
    expect_bad_file("truncated",
                    "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", zeros, 6,
                    "tensor 'w': data_offsets [0, 12)");
    expect_bad_file("corrupt_json", "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],", zeros, 12,
                    "header is not valid JSON");
    expect_bad_file("trailing_garbage", "{}xx", zeros, 0, "header is not valid JSON");
    expect_bad_file("not_object", "[1,2]", zeros, 0, "header is not a JSON object");
    expect_bad_file("outside",
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":[1000],\"data_offsets\":[0,1000]}}", zeros,
                    16, "tensor 'w': data_offsets [0, 1000) run past the end");
    expect_bad_file("overlap",
                    "{\"p\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                    "\"q\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                    zeros, 12, "tensor 'q': data_offsets [4, 12) overlap tensor 'p'");
    expect_bad_file("overlap_nested",
                    "{\"big\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
                    "\"mid\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]},"
                    "\"late\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[10,12]}}",
                    zeros, 16, "overlap tensor 'big'");
    expect_bad_file(
        "size_mismatch",
        "{\"model.norm.weight\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,10]}}", zeros,
        10,
        "tensor 'model.norm.weight': data_offsets [0, 10) hold 10 bytes but shape [4] of BF16 "
        "needs 8");
    expect_bad_file("scalar_size",
                    "{\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,8]}}", zeros, 8,
                    "shape [] of F32 needs 4");
    expect_bad_file("unknown_dtype",
                    "{\"w\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,1]}}", zeros, 1,
                    "tensor 'w': unknown dtype \"F4\"");
    expect_bad_file("missing_dtype", "{\"w\":{\"shape\":[2],\"data_offsets\":[0,2]}}", zeros, 2,
                    "tensor 'w': dtype is missing");
    expect_bad_file("negative_dim",
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":[2,-1],\"data_offsets\":[0,2]}}", zeros, 2,
                    "tensor 'w': shape[1] is not a non-negative integer");
    expect_bad_file("fraction_dim",
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,2]}}", zeros, 2,
                    "tensor 'w': shape[0]");
    expect_bad_file("shape_string",
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":\"2\",\"data_offsets\":[0,2]}}", zeros, 2,
                    "tensor 'w': shape is not an array");
    expect_bad_file("offsets_reversed",
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,2]}}", zeros, 8,
                    "tensor 'w': data_offsets [4, 2) end before they begin");
    expect_bad_file("offsets_three",
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2,4]}}", zeros, 8,
                    "tensor 'w': data_offsets is not a pair");
    expect_bad_file(
        "too_many_dims",
        "{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", zeros, 8,
        "tensor 'w': shape has 9 dimensions");
    expect_bad_file("numel_overflow",
                    "{\"w\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296],"
                    "\"data_offsets\":[0,8]}}",
                    zeros, 8, "tensor 'w': shape [4294967296, 4294967296] of F64 overflows");
    expect_bad_file("entry_not_object", "{\"w\":3}", zeros, 0,
                    "tensor 'w': header entry is not a JSON object");
    expect_bad_file("duplicate_in_file",
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                    "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                    zeros, 2, "tensor 'w' appears twice");

    /* Header length over the limit, in a file far smaller than it. */
    const char *dir = new_dir("huge_header");
    char *path = join(dir, "model.safetensors");
    unsigned char raw[16] = {0};
    uint64_t big = (uint64_t)SAFETENSORS_MAX_HEADER + 1;
    for (int i = 0; i < 8; i++)
        raw[i] = (unsigned char)(big >> (8 * i));
    write_bytes(path, raw, sizeof raw);
    char err[512] = "";
    checkpoint ck;
    int rc = checkpoint_open_file(&ck, path, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, path, "header length 104857601 exceeds");

    /* Header length within the limit but past the end of the file. */
    dir = new_dir("header_past_end");
    path = join(dir, "model.safetensors");
    raw[0] = 100, raw[1] = raw[2] = raw[3] = 0;
    write_bytes(path, raw, sizeof raw);
    rc = checkpoint_open_file(&ck, path, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, path, "header length 100 runs past the end of the file (16 bytes)");

    /* Shorter than the length field itself. */
    dir = new_dir("tiny");
    path = join(dir, "model.safetensors");
    write_bytes(path, raw, 5);
    rc = checkpoint_open_file(&ck, path, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, path, "file is 5 bytes");

    rc = checkpoint_open_file(&ck, join(tmp_root, "no_such.safetensors"), err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "no_such.safetensors", "cannot open");
}

static void test_bad_folders(void) {
    char err[512] = "";
    checkpoint ck;

    const char *dir = new_dir("empty");
    int rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, dir, "no *.safetensors");

    /* Index naming a file that is not there. */
    dir = new_dir("index_missing_file");
    write_shards(dir);
    const char *index = "{\"weight_map\":{\"x\":\"model-00001-of-00002.safetensors\","
                        "\"w\":\"model-00003-of-00002.safetensors\"}}";
    write_bytes(join(dir, "model.safetensors.index.json"), index, strlen(index));
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "model-00003-of-00002.safetensors", "model.safetensors.index.json");

    /* Index naming a tensor its file does not hold (z is in the other shard, q nowhere). */
    dir = new_dir("index_wrong_file");
    write_shards(dir);
    index = "{\"weight_map\":{\"x\":\"model-00001-of-00002.safetensors\","
            "\"z\":\"model-00001-of-00002.safetensors\"}}";
    write_bytes(join(dir, "model.safetensors.index.json"), index, strlen(index));
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "tensor 'z' is mapped to", "model-00001-of-00002.safetensors");

    dir = new_dir("index_absent_tensor");
    write_shards(dir);
    index = "{\"weight_map\":{\"x\":\"model-00001-of-00002.safetensors\","
            "\"q\":\"model-00002-of-00002.safetensors\"}}";
    write_bytes(join(dir, "model.safetensors.index.json"), index, strlen(index));
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "tensor 'q' is mapped to", "model-00002-of-00002.safetensors");

    dir = new_dir("index_bad_json");
    write_shards(dir);
    write_bytes(join(dir, "model.safetensors.index.json"), "{\"weight_map\":", 14);
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "model.safetensors.index.json", "not valid JSON");

    dir = new_dir("index_no_map");
    write_shards(dir);
    write_bytes(join(dir, "model.safetensors.index.json"), "{\"metadata\":{}}", 15);
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "model.safetensors.index.json", "weight_map is missing");

    dir = new_dir("index_map_value");
    write_shards(dir);
    index = "{\"weight_map\":{\"x\":1}}";
    write_bytes(join(dir, "model.safetensors.index.json"), index, strlen(index));
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "model.safetensors.index.json", "weight_map['x']");

    /* The same name in two shards. */
    dir = new_dir("duplicate_across");
    write_shards(dir);
    write_st(join(dir, "model-00003.safetensors"),
             "{\"y\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "\1", 1, true);
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "tensor 'y' is also in", "model-00001-of-00002.safetensors");
    CHECK(strstr(err, "model-00003.safetensors") != NULL, "names both files: %s", err);

    /* A broken shard among good ones: the whole open fails and nothing leaks (ASan). */
    dir = new_dir("one_bad_shard");
    write_shards(dir);
    write_st(join(dir, "model-00003.safetensors"),
             "{\"v\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", "\1", 1, true);
    rc = checkpoint_open(&ck, dir, err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "model-00003.safetensors", "tensor 'v'");

    rc = checkpoint_open(&ck, join(tmp_root, "no_such_folder"), err, sizeof err);
    EXPECT_FAIL(rc, ck, err, "no_such_folder", "cannot open folder");
}

int main(void) {
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        return 2;
    }
    test_good_single();
    test_unpadded_header();
    test_good_sharded();
    test_bad_files();
    test_bad_folders();
    nftw(tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    CHECK_SUMMARY();
}
