/* train_digits.c: train the digits MLP of examples/digits_mlp.py in C, with
 * no Python, through the library symbackprop generated for it
 * (generated/digits_mlp/: digits_mlp_train_epoch, Adam's update included).
 *
 *   python examples/c/write_digits.py digits.bin      (the data, once)
 *   train_digits digits.bin [EPOCHS [BATCH [LR [SEED]]]]
 *
 * The parameters start as PyTorch's nn.Linear starts them, uniform in
 * +-1/sqrt(fan_in), from SEED; each epoch visits the training rows in a
 * fresh random order in minibatches of BATCH rows. It prints the mean loss
 * of each epoch, then the test loss and accuracy. Build it with the
 * CMakeLists.txt beside it (docs/c_library.md).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "digits_mlp.h"

enum { PIXELS = 64, HIDDEN = 64, CLASSES = 10 }; /* the model's fixed sizes */

typedef struct {
    int64_t rows;
    double *images; /* rows x PIXELS, in [0, 1] */
    double *targets; /* rows x CLASSES, one-hot */
    int64_t *labels; /* rows */
} Set;

static void *allocate(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

static void read_or_die(void *to, size_t size, size_t count, FILE *in, const char *path) {
    if (fread(to, size, count, in) != count) {
        fprintf(stderr, "%s: too short (write it with examples/c/write_digits.py)\n", path);
        exit(1);
    }
}

/* One set of the file: the images, then the labels (kept as one-hot targets too). */
static Set read_set(FILE *in, int64_t rows, const char *path) {
    Set set = {rows, allocate((size_t)rows * PIXELS, sizeof(double)),
               allocate((size_t)rows * CLASSES, sizeof(double)), allocate((size_t)rows, sizeof(int64_t))};
    read_or_die(set.images, sizeof(double), (size_t)rows * PIXELS, in, path);
    read_or_die(set.labels, sizeof(int64_t), (size_t)rows, in, path);
    for (int64_t r = 0; r < rows; r++) {
        if (set.labels[r] < 0 || set.labels[r] >= CLASSES) {
            fprintf(stderr, "%s: label %lld of row %lld is not a digit\n", path, (long long)set.labels[r], (long long)r);
            exit(1);
        }
        set.targets[r * CLASSES + set.labels[r]] = 1.0;
    }
    return set;
}

/* The file of write_digits.py: "SBPDIGIT", 4 int64 sizes, then each set. */
static void read_data(const char *path, Set *train, Set *test) {
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        fprintf(stderr, "the data file is little-endian; this machine is not\n");
        exit(1);
    }
    FILE *in = fopen(path, "rb");
    if (!in) {
        perror(path);
        exit(1);
    }
    char magic[8];
    int64_t sizes[4];
    read_or_die(magic, 1, sizeof magic, in, path);
    read_or_die(sizes, sizeof(int64_t), 4, in, path);
    if (memcmp(magic, "SBPDIGIT", sizeof magic) != 0 || sizes[2] != PIXELS || sizes[3] != CLASSES) {
        fprintf(stderr, "%s is not a digits file of write_digits.py\n", path);
        exit(1);
    }
    if (sizes[0] < 1 || sizes[1] < 1 || sizes[0] > 10000000 || sizes[1] > 10000000) {
        fprintf(stderr, "%s: implausible row counts %lld and %lld\n", path, (long long)sizes[0], (long long)sizes[1]);
        exit(1);
    }
    *train = read_set(in, sizes[0], path);
    *test = read_set(in, sizes[1], path);
    fclose(in);
}

/* splitmix64: a small seeded generator, the same numbers on every machine. */
static uint64_t next_random(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *state) { /* in [0, 1) */
    return (double)(next_random(state) >> 11) * (1.0 / 9007199254740992.0);
}

static void init_uniform(double *p, size_t count, int fan_in, uint64_t *state) {
    double bound = 1.0 / sqrt((double)fan_in);
    for (size_t i = 0; i < count; i++)
        p[i] = (2.0 * uniform(state) - 1.0) * bound;
}

static void shuffle(int64_t *order, int64_t rows, uint64_t *state) { /* Fisher-Yates */
    for (int64_t i = rows - 1; i > 0; i--) {
        int64_t j = (int64_t)(next_random(state) % (uint64_t)(i + 1));
        int64_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 6) {
        fprintf(stderr, "usage: %s DATA_FILE [EPOCHS [BATCH [LR [SEED]]]]\n", argv[0]);
        return 2;
    }
    int epochs = argc > 2 ? atoi(argv[2]) : 20;
    int64_t batch = argc > 3 ? atoll(argv[3]) : 32;
    double lr = argc > 4 ? atof(argv[4]) : 3e-3;
    uint64_t seed = argc > 5 ? strtoull(argv[5], NULL, 10) : 0;
    if (epochs < 1 || batch < 1 || !(lr > 0)) {
        fprintf(stderr, "EPOCHS and BATCH must be positive integers, LR a positive number\n");
        return 2;
    }
    Set train, test;
    read_data(argv[1], &train, &test);

    /* the parameters, and Adam's state: its moments m, v and the step count, all zero */
    double W1[PIXELS * HIDDEN], b1[HIDDEN], W2[HIDDEN * CLASSES], b2[CLASSES];
    double m_W1[PIXELS * HIDDEN] = {0}, v_W1[PIXELS * HIDDEN] = {0}, m_b1[HIDDEN] = {0}, v_b1[HIDDEN] = {0};
    double m_W2[HIDDEN * CLASSES] = {0}, v_W2[HIDDEN * CLASSES] = {0}, m_b2[CLASSES] = {0}, v_b2[CLASSES] = {0};
    double step = 0.0;
    const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
    uint64_t rng = seed;
    init_uniform(W1, PIXELS * HIDDEN, PIXELS, &rng);
    init_uniform(b1, HIDDEN, PIXELS, &rng);
    init_uniform(W2, HIDDEN * CLASSES, HIDDEN, &rng);
    init_uniform(b2, CLASSES, HIDDEN, &rng);

    int64_t batches = (train.rows + batch - 1) / batch;
    int64_t *order = allocate((size_t)train.rows, sizeof(int64_t));
    for (int64_t r = 0; r < train.rows; r++)
        order[r] = r;
    double *losses = allocate((size_t)batches, sizeof(double));
    double *work = allocate(digits_mlp_train_epoch_work_len(train.rows, batch), sizeof(double));
    printf("digits: %lld training and %lld test images; MLP %d -> %d (tanh) -> %d; Adam lr=%g, batch size %lld\n",
           (long long)train.rows, (long long)test.rows, PIXELS, HIDDEN, CLASSES, lr, (long long)batch);
    for (int epoch = 1; epoch <= epochs; epoch++) {
        shuffle(order, train.rows, &rng);
        int status = digits_mlp_train_epoch(train.rows, batch, order, train.images, train.targets, W1, b1, W2, b2,
                                            &lr, &beta1, &beta2, &eps, &weight_decay, &step, m_W1, v_W1, m_b1,
                                            v_b1, m_W2, v_W2, m_b2, v_b2, losses, work);
        if (status != 0) {
            fprintf(stderr, "digits_mlp_train_epoch returned %d\n", status);
            return 1;
        }
        double total = 0.0;
        for (int64_t b = 0; b < batches; b++)
            total += losses[b];
        printf("epoch %3d/%d: mean loss %.5f\n", epoch, epochs, total / (double)batches);
    }

    /* the test set in one forward call: the loss and the logits */
    double loss;
    double *logits = allocate((size_t)test.rows * CLASSES, sizeof(double));
    double *forward_work = allocate(digits_mlp_forward_work_len(test.rows), sizeof(double));
    if (digits_mlp_forward(test.rows, test.images, test.targets, W1, b1, W2, b2, &loss, logits, forward_work) != 0) {
        fprintf(stderr, "digits_mlp_forward failed\n");
        return 1;
    }
    int64_t right = 0;
    for (int64_t r = 0; r < test.rows; r++) {
        int best = 0;
        for (int k = 1; k < CLASSES; k++)
            if (logits[r * CLASSES + k] > logits[r * CLASSES + best])
                best = k;
        right += best == test.labels[r];
    }
    printf("test loss %.5f\n", loss);
    printf("test accuracy: %.4f (%lld of %lld)\n", (double)right / (double)test.rows, (long long)right,
           (long long)test.rows);
    return 0;
}
