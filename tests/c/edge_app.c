/*
 * An "app" that embeds the Cohort edge client through its C API and trains inside its
 * own process: multinomial logistic regression (the built-in `logreg` model's layout,
 * `layers.0.weight` [classes, features] then `layers.0.bias` [classes]) with mini-batch
 * SGD on a local CSV (header row, features, then an integer `label` column).
 *
 *   edge_app COORDINATOR CA_FILE ENROL_TOKEN STATE_DIR DATA.csv FEATURE_SCALE IDLE_SECONDS
 *
 * It serves tasks until none has come for IDLE_SECONDS, prints its status as
 * `uploads=N failed=N skipped=N`, frees the client and exits 0 (1 on any API error).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cohort_edge.h"

typedef struct {
    size_t rows, features;
    float *x;   /* rows * features */
    int *label; /* rows */
} Data;

static int load_csv(const char *path, float scale, Data *d) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[8192];
    if (!fgets(line, sizeof line, f)) { fclose(f); return -1; }
    size_t columns = 1;
    for (char *p = line; *p; p++) if (*p == ',') columns++;
    d->features = columns - 1;
    d->rows = 0;
    size_t cap = 256;
    d->x = malloc(cap * d->features * sizeof(float));
    d->label = malloc(cap * sizeof(int));
    while (fgets(line, sizeof line, f)) {
        if (d->rows == cap) {
            cap *= 2;
            d->x = realloc(d->x, cap * d->features * sizeof(float));
            d->label = realloc(d->label, cap * sizeof(int));
        }
        char *p = line;
        for (size_t j = 0; j < d->features; j++) {
            d->x[d->rows * d->features + j] = strtof(p, &p) * scale;
            if (*p == ',') p++;
        }
        d->label[d->rows] = (int)strtol(p, NULL, 10);
        d->rows++;
    }
    fclose(f);
    return 0;
}

/* Softmax probabilities of row `x` under weights `w` (classes x features) and bias `b`. */
static void softmax(const float *w, const float *b, const float *x, size_t classes,
                    size_t features, double *p) {
    double max = -INFINITY, sum = 0.0;
    for (size_t c = 0; c < classes; c++) {
        double z = b[c];
        for (size_t j = 0; j < features; j++) z += (double)w[c * features + j] * x[j];
        p[c] = z;
        if (z > max) max = z;
    }
    for (size_t c = 0; c < classes; c++) { p[c] = exp(p[c] - max); sum += p[c]; }
    for (size_t c = 0; c < classes; c++) p[c] /= sum;
}

static int train(void *user_data, const CohortTask *task, const float *global, size_t len,
                 float *update, CohortTrainResult *result) {
    const Data *d = user_data;
    size_t features = d->features, classes = len / (features + 1);
    if (classes * (features + 1) != len || !strstr(task->tensors_json, "layers.0.weight"))
        return 2; /* not a logreg model of this data's width */
    double *p = malloc(classes * sizeof(double));
    /* Evaluate the weights received. */
    size_t correct = 0;
    double loss = 0.0;
    for (size_t i = 0; i < d->rows; i++) {
        softmax(global, global + classes * features, d->x + i * features, classes, features, p);
        size_t best = 0;
        for (size_t c = 1; c < classes; c++) if (p[c] > p[best]) best = c;
        correct += best == (size_t)d->label[i];
        loss -= log(p[d->label[i]] + 1e-12);
    }
    result->eval_accuracy = (double)correct / d->rows;
    result->eval_loss = loss / d->rows;
    result->num_examples = d->rows;
    if (task->kind == 1) { free(p); return 0; }

    memcpy(update, global, len * sizeof(float));
    float *w = update, *b = update + classes * features;
    size_t batch = task->batch_size ? task->batch_size : 16;
    float *gw = calloc(classes * features, sizeof(float)), *gb = calloc(classes, sizeof(float));
    double epoch_loss = 0.0;
    for (unsigned e = 0; e < task->local_epochs; e++) {
        epoch_loss = 0.0;
        for (size_t start = 0; start < d->rows; start += batch) {
            size_t end = start + batch < d->rows ? start + batch : d->rows;
            memset(gw, 0, classes * features * sizeof(float));
            memset(gb, 0, classes * sizeof(float));
            for (size_t i = start; i < end; i++) {
                const float *x = d->x + i * features;
                softmax(w, b, x, classes, features, p);
                epoch_loss -= log(p[d->label[i]] + 1e-12);
                for (size_t c = 0; c < classes; c++) {
                    double g = p[c] - (c == (size_t)d->label[i]);
                    gb[c] += g;
                    for (size_t j = 0; j < features; j++) gw[c * features + j] += g * x[j];
                }
            }
            float step = task->lr / (float)(end - start);
            for (size_t k = 0; k < classes * features; k++)
                w[k] -= step * gw[k] + task->lr * task->weight_decay * w[k];
            for (size_t c = 0; c < classes; c++) b[c] -= step * gb[c];
        }
    }
    result->train_loss = epoch_loss / d->rows;
    free(gw);
    free(gb);
    free(p);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s COORDINATOR CA_FILE TOKEN STATE_DIR DATA.csv SCALE IDLE\n", argv[0]);
        return 2;
    }
    Data data;
    if (load_csv(argv[5], strtof(argv[6], NULL), &data) != 0) {
        fprintf(stderr, "cannot read %s\n", argv[5]);
        return 2;
    }
    char config[4096];
    snprintf(config, sizeof config,
             "{\"coordinator\": \"%s\", \"ca_cert_file\": \"%s\", \"enrol_token\": \"%s\", "
             "\"state_dir\": \"%s\"}",
             argv[1], argv[2], argv[3], argv[4]);
    printf("cohort edge library %s\n", cohort_version());

    CohortError err = {0};
    CohortClient *client = NULL;
    int code = 0;
    /* Bad input gets a code and a message, never a crash. */
    if (cohort_client_new("{\"coordinator\": 3}", &client, &err) != CohortInvalidConfig ||
        client != NULL) {
        fprintf(stderr, "a bad configuration was not refused\n");
        code = 1;
    }
    if (cohort_client_new(config, &client, &err) != CohortOk) {
        fprintf(stderr, "cohort_client_new: %s\n", err.message);
        return 1;
    }
    if (cohort_client_run_pending(client, train, &data, (uint32_t)atoi(argv[7]), &err) != CohortOk) {
        fprintf(stderr, "cohort_client_run_pending: %s\n", err.message);
        code = 1;
    }
    CohortStatus status;
    if (cohort_client_status(client, &status, &err) != CohortOk) {
        fprintf(stderr, "cohort_client_status: %s\n", err.message);
        code = 1;
    }
    printf("enrolled=%d uploads=%llu failed=%llu skipped=%llu\n", status.enrolled,
           (unsigned long long)status.uploads, (unsigned long long)status.failed,
           (unsigned long long)status.skipped);
    cohort_client_free(client);
    free(data.x);
    free(data.label);
    return code;
}
