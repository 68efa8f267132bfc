/* A tiny test harness: CHECK counts and reports, the last line is "N passed, M failed".
 * Each test file is its own binary; tests/run.sh adds the lines up. */
#ifndef MOESERVE_CHECK_H
#define MOESERVE_CHECK_H

#include <math.h>
#include <stdio.h>

static int check_passed __attribute__((unused)), check_failed __attribute__((unused));

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            check_passed++;                                                                        \
        } else {                                                                                   \
            check_failed++;                                                                        \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

/* |got - want| <= atol + rtol * |want| */
#define CHECK_CLOSE(got, want, atol, rtol, what)                                                   \
    do {                                                                                           \
        double g_ = (got), w_ = (want);                                                            \
        CHECK(fabs(g_ - w_) <= (atol) + (rtol) * fabs(w_), "%s: got %.9g want %.9g", (what), g_,  \
              w_);                                                                                 \
    } while (0)

#define CHECK_SUMMARY()                                                                            \
    do {                                                                                           \
        printf("%d passed, %d failed\n", check_passed, check_failed);                              \
        return check_failed ? 1 : 0;                                                               \
    } while (0)

#endif
