/*
 * An app whose training callback is slow and writes into memory the app owns, to check
 * that the library never calls it once `cohort_client_run_pending` has returned, and
 * never twice at once, even when a secure round is abandoned while it trains.
 *
 *   abandon_app COORDINATOR CA_FILE ENROL_TOKEN STATE_DIR TASKS CALLBACK_MS
 *
 * It first enrols (a run that finds no task) and prints `enrolled`. Then, TASKS times,
 * it waits for a line on stdin (the test's go-ahead, once it has opened a round),
 * creates a client, serves tasks until none has come for a second, and:
 *   - frees the memory it lent the callback as soon as `cohort_client_run_pending`
 *     returns (the API lends `user_data` for the call only);
 *   - frees the client, then the scratch memory the callback also writes to;
 *   - prints `returned N code=C calls=K` (K: callback calls so far).
 * The callback runs for CALLBACK_MS milliseconds, writing into both all the while: a
 * call still running after either is freed is an invalid write under valgrind. It also
 * counts calls that overlap another or run outside `cohort_client_run_pending`.
 *
 * At the end (stdin closed) it waits as long as a callback takes, prints
 * `calls=K overlaps=N outside=M` and exits 0 when both N and M are 0, 3 otherwise
 * (1 on an API error).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cohort_edge.h"

/* What one run lends the callback. */
typedef struct {
    float *weights; /* a copy of the global weights, rewritten as the callback "trains" */
    size_t len;
    float *scratch; /* the app's own, freed after cohort_client_free */
    size_t scratch_len;
} Run;

static atomic_int active;         /* callbacks running now */
static atomic_int calls;          /* callbacks started */
static atomic_int overlaps;       /* callbacks that found another one running */
static atomic_int outside;        /* callback moments outside cohort_client_run_pending */
static atomic_int in_run_pending; /* 1 while cohort_client_run_pending runs */
static long callback_ms;

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int train(void *user_data, const CohortTask *task, const float *global, size_t len,
                 float *update, CohortTrainResult *result) {
    (void)task;
    atomic_fetch_add(&calls, 1);
    if (atomic_fetch_add(&active, 1) != 0) atomic_fetch_add(&overlaps, 1);
    if (!atomic_load(&in_run_pending)) atomic_fetch_add(&outside, 1);
    Run *run = user_data;
    if (run->len != len) {
        run->weights = realloc(run->weights, len * sizeof(float));
        run->len = len;
    }
    memcpy(run->weights, global, len * sizeof(float));
    for (long step = 0; step < callback_ms / 10; step++) {
        run->weights[(size_t)step % len] += 0.0f;
        run->scratch[(size_t)step % run->scratch_len] = (float)step;
        sleep_ms(10);
    }
    if (update) memcpy(update, run->weights, len * sizeof(float));
    result->num_examples = 10;
    result->train_loss = 0.5;
    if (!atomic_load(&in_run_pending)) atomic_fetch_add(&outside, 1);
    atomic_fetch_sub(&active, 1);
    return 0;
}

/* One client's life: new, serve until idle, free; 0 or the failing call's code. */
static int serve(const char *config, unsigned idle_seconds) {
    CohortError err = {0};
    CohortClient *client = NULL;
    if (cohort_client_new(config, &client, &err) != CohortOk) {
        fprintf(stderr, "cohort_client_new: %s\n", err.message);
        return -1;
    }
    float *scratch = calloc(64, sizeof(float));
    Run *run = calloc(1, sizeof *run);
    run->scratch = scratch;
    run->scratch_len = 64;
    atomic_store(&in_run_pending, 1);
    CohortCode code = cohort_client_run_pending(client, train, run, idle_seconds, &err);
    atomic_store(&in_run_pending, 0);
    if (code != CohortOk) fprintf(stderr, "cohort_client_run_pending: %s\n", err.message);
    /* The loan of user_data ends with the call. */
    free(run->weights);
    free(run);
    cohort_client_free(client);
    free(scratch);
    return (int)code;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s COORDINATOR CA_FILE TOKEN STATE_DIR TASKS CALLBACK_MS\n",
                argv[0]);
        return 2;
    }
    char config[4096];
    snprintf(config, sizeof config,
             "{\"coordinator\": \"%s\", \"ca_cert_file\": \"%s\", \"enrol_token\": \"%s\", "
             "\"state_dir\": \"%s\"}",
             argv[1], argv[2], argv[3], argv[4]);
    int tasks = atoi(argv[5]);
    callback_ms = atol(argv[6]);
    setvbuf(stdout, NULL, _IOLBF, 0);

    if (serve(config, 1) != 0) return 1;
    printf("enrolled\n");
    char line[64];
    for (int n = 0; n < tasks && fgets(line, sizeof line, stdin); n++) {
        int code = serve(config, 1);
        printf("returned %d code=%d calls=%d\n", n, code, atomic_load(&calls));
    }
    while (fgets(line, sizeof line, stdin)) {
    }
    /* A callback the library left running would finish (or fault) by now. */
    sleep_ms(callback_ms + 500);
    printf("calls=%d overlaps=%d outside=%d\n", atomic_load(&calls), atomic_load(&overlaps),
           atomic_load(&outside));
    return atomic_load(&overlaps) || atomic_load(&outside) ? 3 : 0;
}
