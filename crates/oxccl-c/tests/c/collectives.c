/* Every collective of oxccl.h, over every data type and operator, checked against values
 * computed here from the rank numbers alone. Run by tests/c_api.rs under `oxccl run` and
 * `mpirun`. Prints "ok   NAME" or "FAIL NAME: ..." per check and "checks N failed M" last;
 * exits 0 when nothing failed. */
#include <oxccl.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks, checks, failures;

#define CHECK(call)                                                                     \
  do {                                                                                  \
    oxcclResult_t r_ = (call);                                                          \
    if (r_ != oxcclSuccess) {                                                           \
      printf("FAIL %s:%d %s: %s: %s\n", __FILE__, __LINE__, #call,                      \
             oxcclGetErrorString(r_), oxcclGetLastError(NULL));                         \
      exit(2);                                                                          \
    }                                                                                   \
  } while (0)

static void report(const char *name, oxcclDataType_t t, oxcclRedOp_t op, int bad, size_t at,
                   double got, double want) {
  checks++;
  if (bad) {
    failures++;
    printf("FAIL %s dtype %d op %d rank %d: element %zu is %g, want %g\n", name, t, op, rank,
           at, got, want);
  } else {
    printf("ok   %s dtype %d op %d\n", name, t, op);
  }
}

/* ---- element codecs: small exact values in every type ---- */

static size_t size_of(oxcclDataType_t t) {
  switch (t) {
    case oxcclInt8: case oxcclUint8: case oxcclFloat8e4m3: case oxcclFloat8e5m2: return 1;
    case oxcclFloat16: case oxcclBfloat16: return 2;
    case oxcclInt32: case oxcclUint32: case oxcclFloat32: return 4;
    default: return 8;
  }
}

/* A binary float of `eb` exponent and `mb` mantissa bits holding v (exact, normal or 0). */
static uint32_t enc(double v, int eb, int mb) {
  if (v == 0) return 0;
  uint32_t sign = v < 0 ? 1u : 0u;
  double a = fabs(v);
  int e = 0;
  while (a >= 2) { a /= 2; e++; }
  while (a < 1) { a *= 2; e--; }
  uint32_t bias = (1u << (eb - 1)) - 1;
  uint32_t mant = (uint32_t)((a - 1) * (double)(1u << mb));
  return (sign << (eb + mb)) | ((uint32_t)(e + (int)bias) << mb) | mant;
}

static double dec(uint32_t bits, int eb, int mb) {
  uint32_t mant = bits & ((1u << mb) - 1), ex = (bits >> mb) & ((1u << eb) - 1);
  double sign = (bits >> (eb + mb)) & 1 ? -1 : 1;
  if (ex == 0) return sign * ldexp((double)mant, 1 - (int)((1u << (eb - 1)) - 1) - mb);
  return sign * ldexp(1 + (double)mant / (double)(1u << mb), (int)ex - (int)((1u << (eb - 1)) - 1));
}

static void put(oxcclDataType_t t, void *buf, size_t i, double v) {
  char *p = (char *)buf + i * size_of(t);
  switch (t) {
    case oxcclInt8: *(int8_t *)p = (int8_t)v; break;
    case oxcclUint8: *(uint8_t *)p = (uint8_t)v; break;
    case oxcclInt32: *(int32_t *)p = (int32_t)v; break;
    case oxcclUint32: *(uint32_t *)p = (uint32_t)v; break;
    case oxcclInt64: *(int64_t *)p = (int64_t)v; break;
    case oxcclUint64: *(uint64_t *)p = (uint64_t)v; break;
    case oxcclFloat32: *(float *)p = (float)v; break;
    case oxcclFloat64: *(double *)p = v; break;
    case oxcclFloat16: *(uint16_t *)p = (uint16_t)enc(v, 5, 10); break;
    case oxcclBfloat16: *(uint16_t *)p = (uint16_t)enc(v, 8, 7); break;
    case oxcclFloat8e4m3: *(uint8_t *)p = (uint8_t)enc(v, 4, 3); break;
    case oxcclFloat8e5m2: *(uint8_t *)p = (uint8_t)enc(v, 5, 2); break;
  }
}

static double get(oxcclDataType_t t, const void *buf, size_t i) {
  const char *p = (const char *)buf + i * size_of(t);
  switch (t) {
    case oxcclInt8: return *(const int8_t *)p;
    case oxcclUint8: return *(const uint8_t *)p;
    case oxcclInt32: return *(const int32_t *)p;
    case oxcclUint32: return *(const uint32_t *)p;
    case oxcclInt64: return (double)*(const int64_t *)p;
    case oxcclUint64: return (double)*(const uint64_t *)p;
    case oxcclFloat32: return *(const float *)p;
    case oxcclFloat64: return *(const double *)p;
    case oxcclFloat16: return dec(*(const uint16_t *)p, 5, 10);
    case oxcclBfloat16: return dec(*(const uint16_t *)p, 8, 7);
    case oxcclFloat8e4m3: return dec(*(const uint8_t *)p, 4, 3);
    case oxcclFloat8e5m2: return dec(*(const uint8_t *)p, 5, 2);
  }
  return NAN;
}

static int is_int(oxcclDataType_t t) { return t <= oxcclUint64; }

/* ---- the values: rank r's element i ---- */

/* Reduced: 1, 2 or 3 (sums, products and averages stay exact in every type used). */
static double a(int r, size_t i) { return (double)((r + (int)i) % 3 + 1); }
/* Copied: 1 to 8 (exact even in fp8 e5m2). */
static double b(int r, size_t i) { return (double)((r * 3 + (int)i) % 8 + 1); }

static double reduced(oxcclDataType_t t, oxcclRedOp_t op, size_t i) {
  double acc = a(0, i);
  for (int r = 1; r < nranks; r++) {
    double v = a(r, i);
    switch (op) {
      case oxcclSum: case oxcclAvg: acc += v; break;
      case oxcclProd: acc *= v; break;
      case oxcclMax: acc = v > acc ? v : acc; break;
      case oxcclMin: acc = v < acc ? v : acc; break;
    }
  }
  if (op == oxcclAvg) acc = is_int(t) ? trunc(acc / nranks) : acc / nranks;
  return acc;
}

/* The operators whose results the type holds exactly (fp8 sums round; see a()). */
static int op_fits(oxcclDataType_t t, oxcclRedOp_t op) {
  if (t == oxcclFloat8e5m2) return op == oxcclMax || op == oxcclMin;
  if (t == oxcclFloat8e4m3) return op == oxcclMax || op == oxcclMin || op == oxcclSum;
  return 1;
}

static void *alloc(oxcclDataType_t t, size_t n) { return calloc(n ? n : 1, size_of(t)); }

/* ---- the reducing collectives ---- */

static void reductions(oxcclComm_t comm, oxcclDataType_t t, oxcclRedOp_t op, size_t n) {
  size_t es = size_of(t), N = n * (size_t)nranks;
  void *s = alloc(t, N), *d = alloc(t, N);
  int bad; size_t at; double got, want;
#define SCAN(len, expr_want, buf, off)                                   \
  bad = 0; at = 0; got = want = 0;                                       \
  for (size_t i = 0; i < (len) && !bad; i++) {                           \
    want = (expr_want); got = get(t, buf, (off) + i);                    \
    if (got != want) { bad = 1; at = i; }                                \
  }

  /* all-reduce, out of place then in place */
  for (size_t i = 0; i < n; i++) put(t, s, i, a(rank, i));
  CHECK(oxcclAllReduce(s, d, n, t, op, comm));
  SCAN(n, reduced(t, op, i), d, 0);
  report("all_reduce", t, op, bad, at, got, want);
  CHECK(oxcclAllReduce(s, s, n, t, op, comm));
  SCAN(n, reduced(t, op, i), s, 0);
  report("all_reduce_in_place", t, op, bad, at, got, want);

  /* reduce to the last rank */
  int root = nranks - 1;
  for (size_t i = 0; i < n; i++) put(t, s, i, a(rank, i));
  memset(d, 0, N * es);
  CHECK(oxcclReduce(s, d, n, t, op, root, comm));
  if (rank == root) { SCAN(n, reduced(t, op, i), d, 0); } else { SCAN(n, 0.0, d, 0); }
  report("reduce", t, op, bad, at, got, want);

  /* reduce-scatter: block j of rank r's input holds a(r, j*n + i) */
  for (size_t i = 0; i < N; i++) put(t, s, i, a(rank, i));
  CHECK(oxcclReduceScatter(s, d, n, t, op, comm));
  SCAN(n, reduced(t, op, (size_t)rank * n + i), d, 0);
  report("reduce_scatter", t, op, bad, at, got, want);
  CHECK(oxcclReduceScatter(s, (char *)s + (size_t)rank * n * es, n, t, op, comm));
  SCAN(n, reduced(t, op, (size_t)rank * n + i), s, (size_t)rank * n);
  report("reduce_scatter_in_place", t, op, bad, at, got, want);
  free(s);
  free(d);
}

/* ---- the copying collectives ---- */

static void copies(oxcclComm_t comm, oxcclDataType_t t, size_t n) {
  size_t es = size_of(t), N = n * (size_t)nranks;
  oxcclRedOp_t op = oxcclSum; /* unused; for the report */
  void *s = alloc(t, N), *d = alloc(t, N);
  int bad; size_t at; double got, want;
  int root = 1 % nranks;

  for (size_t i = 0; i < n; i++) put(t, s, i, rank == root ? b(root, i) : 0);
  CHECK(oxcclBroadcast(s, d, n, t, root, comm));
  SCAN(n, b(root, i), d, 0);
  report("broadcast", t, op, bad, at, got, want);
  for (size_t i = 0; i < n; i++) put(t, d, i, rank == root ? b(root, i) : 0);
  CHECK(oxcclBroadcast(d, d, n, t, root, comm));
  SCAN(n, b(root, i), d, 0);
  report("broadcast_in_place", t, op, bad, at, got, want);

  for (size_t i = 0; i < n; i++) put(t, s, i, b(rank, i));
  CHECK(oxcclAllGather(s, d, n, t, comm));
  SCAN(N, b((int)(i / n), i % n), d, 0);
  report("all_gather", t, op, bad, at, got, want);
  memset(d, 0, N * es);
  for (size_t i = 0; i < n; i++) put(t, d, (size_t)rank * n + i, b(rank, i));
  CHECK(oxcclAllGather((char *)d + (size_t)rank * n * es, d, n, t, comm));
  SCAN(N, b((int)(i / n), i % n), d, 0);
  report("all_gather_in_place", t, op, bad, at, got, want);

  /* all-to-all: rank r sends b(r, j*n + i) to rank j */
  for (size_t i = 0; i < N; i++) put(t, s, i, b(rank, i));
  CHECK(oxcclAllToAll(s, d, n, t, comm));
  SCAN(N, b((int)(i / n), (size_t)rank * n + i % n), d, 0);
  report("all_to_all", t, op, bad, at, got, want);

  memset(d, 0, N * es);
  for (size_t i = 0; i < n; i++) put(t, s, i, b(rank, i));
  CHECK(oxcclGather(s, d, n, t, root, comm));
  if (rank == root) { SCAN(N, b((int)(i / n), i % n), d, 0); } else { SCAN(N, 0.0, d, 0); }
  report("gather", t, op, bad, at, got, want);

  for (size_t i = 0; i < N; i++) put(t, s, i, rank == root ? b(root, i) : 0);
  CHECK(oxcclScatter(s, d, n, t, root, comm));
  SCAN(n, b(root, (size_t)rank * n + i), d, 0);
  report("scatter", t, op, bad, at, got, want);

  if (nranks > 1) {
    /* a ring of sends and receives, in one group */
    int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    for (size_t i = 0; i < n; i++) put(t, s, i, b(rank, i));
    memset(d, 0, n * es);
    CHECK(oxcclGroupStart());
    CHECK(oxcclSend(s, n, t, next, comm));
    CHECK(oxcclRecv(d, n, t, prev, comm));
    CHECK(oxcclGroupEnd());
    SCAN(n, b(prev, i), d, 0);
    report("send_recv", t, op, bad, at, got, want);
  }
  CHECK(oxcclBarrier(comm));
  report("barrier", t, op, 0, 0, 0, 0);
  free(s);
  free(d);
}

/* ---- beyond the collectives: unique ids, split, registration, groups of collectives ---- */

static void communicators(oxcclComm_t comm) {
  /* A second communicator through a unique id that rank 0 makes and broadcasts. */
  oxcclUniqueId id;
  memset(&id, 0, sizeof id);
  if (rank == 0) CHECK(oxcclGetUniqueId(&id));
  CHECK(oxcclBroadcast(&id, &id, sizeof id, oxcclUint8, 0, comm));
  oxcclComm_t byid;
  CHECK(oxcclCommInitRank(&byid, nranks, id, rank));
  int64_t x = rank + 1, sum = 0;
  CHECK(oxcclAllReduce(&x, &sum, 1, oxcclInt64, oxcclSum, byid));
  report("init_rank_all_reduce", oxcclInt64, oxcclSum, sum != (int64_t)nranks * (nranks + 1) / 2,
         0, (double)sum, nranks * (nranks + 1) / 2.0);
  CHECK(oxcclCommDestroy(byid));

  /* Split by parity, ordered by descending rank. */
  oxcclComm_t half;
  CHECK(oxcclCommSplit(comm, rank % 2, nranks - rank, &half));
  int hr, hn;
  CHECK(oxcclCommUserRank(half, &hr));
  CHECK(oxcclCommCount(half, &hn));
  int32_t mine = rank, total = 0, want = 0, wn = 0;
  for (int r = rank % 2; r < nranks; r += 2) { want += r; wn++; }
  CHECK(oxcclAllReduce(&mine, &total, 1, oxcclInt32, oxcclSum, half));
  report("split_all_reduce", oxcclInt32, oxcclSum, total != want || hn != wn || hr != (wn - 1 - rank / 2),
         0, total, want);
  CHECK(oxcclCommDestroy(half));

  /* A registered buffer, and two collectives in one group. */
  size_t n = 4096;
  float *buf = calloc(n, sizeof(float)), *other = calloc(n, sizeof(float));
  void *handle;
  CHECK(oxcclCommRegister(comm, buf, n * sizeof(float), &handle));
  for (size_t i = 0; i < n; i++) { buf[i] = (float)a(rank, i); other[i] = (float)b(rank, i); }
  CHECK(oxcclGroupStart());
  CHECK(oxcclAllReduce(buf, buf, n, oxcclFloat32, oxcclSum, comm));
  CHECK(oxcclAllReduce(other, other, n, oxcclFloat32, oxcclMax, comm));
  CHECK(oxcclGroupEnd());
  int bad = 0;
  for (size_t i = 0; i < n && !bad; i++) {
    double m = 0;
    for (int r = 0; r < nranks; r++) m = b(r, i) > m ? b(r, i) : m;
    bad = buf[i] != (float)reduced(oxcclFloat32, oxcclSum, i) || other[i] != (float)m;
  }
  report("group_registered_all_reduces", oxcclFloat32, oxcclSum, bad, 0, 0, 0);
  CHECK(oxcclCommDeregister(comm, handle));
  free(buf);
  free(other);
}

/* ---- error paths: codes and messages, and the communicator still works ---- */

static void expect(const char *name, oxcclResult_t got, oxcclResult_t want, const char *needle) {
  const char *msg = oxcclGetLastError(NULL);
  int bad = got != want || strstr(msg, needle) == NULL;
  checks++;
  if (bad) {
    failures++;
    printf("FAIL %s: code %d (want %d), message \"%s\" (want \"%s\" in it)\n", name, got, want,
           msg, needle);
  } else {
    printf("ok   %s: %s\n", name, msg);
  }
}

static void errors(oxcclComm_t comm) {
  int32_t x[4] = {1, 2, 3, 4}, y[4];
  expect("error_null_comm", oxcclAllReduce(x, y, 4, oxcclInt32, oxcclSum, NULL),
         oxcclInvalidArgument, "oxcclAllReduce(count=4, datatype=oxcclInt32, op=oxcclSum): comm is NULL");
  expect("error_bad_dtype", oxcclAllReduce(x, y, 4, (oxcclDataType_t)42, oxcclSum, comm),
         oxcclInvalidArgument, "datatype 42 is not an oxcclDataType_t");
  expect("error_bad_op", oxcclAllReduce(x, y, 4, oxcclInt32, (oxcclRedOp_t)9, comm),
         oxcclInvalidArgument, "op 9 is not an oxcclRedOp_t");
  expect("error_peer_out_of_range", oxcclSend(x, 4, oxcclInt32, nranks, comm),
         oxcclInvalidArgument, "is outside the communicator's");
  expect("error_root_negative", oxcclBroadcast(x, y, 4, oxcclInt32, -3, comm),
         oxcclInvalidArgument, "root -3 is negative");
  expect("error_null_buffer", oxcclAllGather(NULL, y, 1, oxcclInt32, comm),
         oxcclInvalidArgument, "sendbuff is NULL");
  expect("error_overlap", oxcclAllReduce(x, x + 1, 2, oxcclInt32, oxcclSum, comm),
         oxcclInvalidArgument, "overlap");
  expect("error_group_end_alone", oxcclGroupEnd(), oxcclInvalidUsage, "no group is open");
  oxcclResult_t async = oxcclTimeout;
  CHECK(oxcclCommGetAsyncError(comm, &async));
  report("no_async_error", oxcclInt32, oxcclSum, async != oxcclSuccess, 0, async, 0);
  if (strcmp(oxcclGetErrorString(oxcclRemoteError), oxcclGetErrorString((oxcclResult_t)77)) == 0)
    failures++;
}

int main(int argc, char **argv) {
  /* Elements per rank (per block): argv[1], else a count that divides nothing evenly. */
  size_t n = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : 37;
  int version;
  CHECK(oxcclGetVersion(&version));
  if (version != OXCCL_VERSION_CODE) { printf("FAIL version %d\n", version); return 1; }
  oxcclComm_t comm;
  CHECK(oxcclCommInitFromEnv(&comm));
  CHECK(oxcclCommUserRank(comm, &rank));
  CHECK(oxcclCommCount(comm, &nranks));

  static const oxcclDataType_t types[] = {
      oxcclInt8, oxcclUint8, oxcclInt32, oxcclUint32, oxcclInt64, oxcclUint64,
      oxcclFloat16, oxcclFloat32, oxcclFloat64, oxcclBfloat16, oxcclFloat8e4m3, oxcclFloat8e5m2};
  static const oxcclRedOp_t ops[] = {oxcclSum, oxcclProd, oxcclMax, oxcclMin, oxcclAvg};
  for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
    for (size_t o = 0; o < sizeof ops / sizeof *ops; o++)
      if (op_fits(types[t], ops[o])) reductions(comm, types[t], ops[o], n);
    copies(comm, types[t], n);
  }
  /* A larger all-reduce (pipelined through the slots) and a count of 0. */
  reductions(comm, oxcclFloat32, oxcclSum, 70001);
  reductions(comm, oxcclInt32, oxcclMax, 0);
  communicators(comm);
  errors(comm);
  CHECK(oxcclCommDestroy(comm));
  printf("rank %d: checks %d failed %d\n", rank, checks, failures);
  return failures ? 1 : 0;
}
