/* The ofi provider's C shim: libfabric's calls are mostly `static inline` functions reaching
 * through a fid's ops table, and its attributes are nested structs; this file turns the few the
 * provider uses into plain functions over plain arguments, so that the Rust side declares them
 * with `extern "C"` and never lays out a libfabric struct itself (only fi_cq_data_entry, which
 * is five words). Every function returns libfabric's convention: 0 or a count, or -FI_E*. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* libfabric is loaded at run time (dlopen, as NCCL loads its net plugins), never linked: a
 * program built with this provider runs on a machine without libfabric until it asks for ofi.
 * Only these six of its calls are exported symbols (the rest are inline calls through a fid's
 * ops table, some of which call these): the macros rename them, in libfabric's own headers
 * too, to the functions below, which call through the pointers oxofi_load fills. A libfabric
 * symbol used without a line here stays undefined and fails the link of every binary. */
#define fi_version oxofi_dl_version
#define fi_getinfo oxofi_dl_getinfo
#define fi_freeinfo oxofi_dl_freeinfo
#define fi_dupinfo oxofi_dl_dupinfo
#define fi_fabric oxofi_dl_fabric
#define fi_strerror oxofi_dl_strerror

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

static struct {
	uint32_t (*version)(void);
	int (*getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *,
		       struct fi_info **);
	void (*freeinfo)(struct fi_info *);
	struct fi_info *(*dupinfo)(const struct fi_info *);
	int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
	const char *(*strerror)(int);
} lib;
static char load_err[512];
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

uint32_t fi_version(void) { return lib.version(); }
int fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
	       const struct fi_info *hints, struct fi_info **info)
{
	return lib.getinfo(version, node, service, flags, hints, info);
}
void fi_freeinfo(struct fi_info *info)
{
	if (info) lib.freeinfo(info);
}
struct fi_info *fi_dupinfo(const struct fi_info *info) { return lib.dupinfo(info); }
int fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context)
{
	return lib.fabric(attr, fabric, context);
}
const char *fi_strerror(int errnum)
{
	return lib.strerror ? lib.strerror(errnum) : "libfabric is not loaded";
}

static void restore_signals(void);

/* The oldest libfabric whose ABI this shim is written for (fi_getinfo asks for it too). */
#define OXOFI_MIN_VERSION FI_VERSION(1, 17)

static void load(void)
{
	static const char *const names[] = {"libfabric.so.1", "libfabric.so"};
	const char *why = "";
	void *h = NULL;
	for (unsigned i = 0; i < sizeof names / sizeof names[0] && !h; i++) {
		h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
		if (!h && i == 0) why = dlerror();
	}
	if (!h) {
		snprintf(load_err, sizeof load_err,
			 "cannot load libfabric (%s): install libfabric 1.17 or later (Debian/Ubuntu: "
			 "apt-get install libfabric1), or use another provider (OXCCL_PROVIDER=shm or tcp)",
			 why);
		return;
	}
#define SYM(field, name)                                                                    \
	do {                                                                               \
		*(void **)&lib.field = dlsym(h, name);                                         \
		if (!lib.field) {                                                          \
			snprintf(load_err, sizeof load_err,                                \
				 "libfabric loaded but has no %s: a libfabric older than 1.17?", \
				 name);                                                    \
			return;                                                            \
		}                                                                          \
	} while (0)
	SYM(version, "fi_version");
	SYM(getinfo, "fi_getinfo");
	SYM(freeinfo, "fi_freeinfo");
	SYM(dupinfo, "fi_dupinfo");
	SYM(fabric, "fi_fabric");
	SYM(strerror, "fi_strerror");
#undef SYM
	uint32_t v = lib.version();
	if (v < OXOFI_MIN_VERSION) {
		snprintf(load_err, sizeof load_err,
			 "libfabric %u.%u is older than 1.17, the oldest the ofi provider supports",
			 FI_MAJOR(v), FI_MINOR(v));
		lib.strerror = NULL;
		return;
	}
	restore_signals();
}

/* Loads libfabric once. 0, or -FI_ENOSYS with the reason in `err`. */
int oxofi_load(char *err, size_t errlen)
{
	pthread_once(&load_once, load);
	if (load_err[0]) {
		snprintf(err, errlen, "%s", load_err);
		return -FI_ENOSYS;
	}
	return 0;
}

struct oxofi {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	struct fid_cq *cq;
	struct fid_ep *ep;
};

/* What the Rust side learns about the opened endpoint. */
struct oxofi_attr {
	uint64_t mr_mode;
	uint64_t caps;
	uint64_t mode;
	uint64_t msg_order;
	uint64_t max_msg_size;
	uint64_t inject_size;
	uint64_t iov_limit;
	uint64_t rma_iov_limit;
	uint64_t mr_key_size;
	uint64_t name_len;
	uint64_t waits; /* 1: the CQ has a wait object (fi_cq_sread blocks) */
	char prov[64];
	char fabric[128];
	unsigned char name[256];
};

static void close_all(struct oxofi *o)
{
	if (o->ep) fi_close(&o->ep->fid);
	if (o->av) fi_close(&o->av->fid);
	if (o->cq) fi_close(&o->cq->fid);
	if (o->domain) fi_close(&o->domain->fid);
	if (o->fabric) fi_close(&o->fabric->fid);
	if (o->info) fi_freeinfo(o->info);
	free(o);
}

#define FAIL(what)                                                                         \
	do {                                                                               \
		snprintf(err, errlen, "%s: %s (%d)", what, fi_strerror(-ret), ret);        \
		close_all(o);                                                              \
		return ret;                                                                \
	} while (0)

/* Opens fabric, domain, address vector, completion queue and one RDM endpoint of provider
 * `prov` (NULL: libfabric's choice), bound to `node` (NULL: the provider's default). `wait`:
 * ask for a CQ wait object (fi_cq_sread). */
int oxofi_open(const char *prov, const char *node, int wait, struct oxofi **out,
	       struct oxofi_attr *attr, char *err, size_t errlen)
{
	int ret = oxofi_load(err, errlen);
	if (ret) return ret;
	struct oxofi *o = calloc(1, sizeof *o);
	struct fi_info *hints = fi_allocinfo();
	if (!o || !hints) {
		snprintf(err, errlen, "out of memory");
		free(o);
		fi_freeinfo(hints);
		return -FI_ENOMEM;
	}
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_MSG | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE |
		      FI_SEND | FI_RECV;
	/* Every context handed to libfabric is our own 64-byte scratch area. */
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED |
				      FI_MR_ENDPOINT;
	hints->domain_attr->threading = FI_THREAD_SAFE;
	hints->tx_attr->msg_order = FI_ORDER_SAS;
	hints->rx_attr->msg_order = FI_ORDER_SAS;
	if (prov && *prov)
		hints->fabric_attr->prov_name = strdup(prov);
	ret = fi_getinfo(FI_VERSION(1, 17), node, NULL, 0, hints, &o->info);
	fi_freeinfo(hints);
	if (ret) {
		o->info = NULL;
		FAIL("fi_getinfo");
	}
	ret = fi_fabric(o->info->fabric_attr, &o->fabric, NULL);
	if (ret) FAIL("fi_fabric");
	ret = fi_domain(o->fabric, o->info, &o->domain, NULL);
	if (ret) FAIL("fi_domain");
	struct fi_cq_attr cq_attr = {0};
	cq_attr.format = FI_CQ_FORMAT_DATA;
	cq_attr.size = 4096;
	cq_attr.wait_obj = wait ? FI_WAIT_UNSPEC : FI_WAIT_NONE;
	ret = fi_cq_open(o->domain, &cq_attr, &o->cq, NULL);
	if (ret && wait) {
		wait = 0;
		cq_attr.wait_obj = FI_WAIT_NONE;
		ret = fi_cq_open(o->domain, &cq_attr, &o->cq, NULL);
	}
	if (ret) FAIL("fi_cq_open");
	struct fi_av_attr av_attr = {0};
	av_attr.type = FI_AV_TABLE;
	ret = fi_av_open(o->domain, &av_attr, &o->av, NULL);
	if (ret) FAIL("fi_av_open");
	ret = fi_endpoint(o->domain, o->info, &o->ep, NULL);
	if (ret) FAIL("fi_endpoint");
	ret = fi_ep_bind(o->ep, &o->av->fid, 0);
	if (ret) FAIL("fi_ep_bind(av)");
	ret = fi_ep_bind(o->ep, &o->cq->fid, FI_TRANSMIT | FI_RECV);
	if (ret) FAIL("fi_ep_bind(cq)");
	ret = fi_enable(o->ep);
	if (ret) FAIL("fi_enable");
	memset(attr, 0, sizeof *attr);
	size_t len = sizeof attr->name;
	ret = fi_getname(&o->ep->fid, attr->name, &len);
	if (ret) FAIL("fi_getname");
	attr->name_len = len;
	attr->mr_mode = o->info->domain_attr->mr_mode;
	attr->caps = o->info->caps;
	attr->mode = o->info->mode;
	attr->msg_order = o->info->tx_attr->msg_order;
	attr->max_msg_size = o->info->ep_attr->max_msg_size;
	attr->inject_size = o->info->tx_attr->inject_size;
	attr->iov_limit = o->info->tx_attr->iov_limit;
	attr->rma_iov_limit = o->info->tx_attr->rma_iov_limit;
	attr->mr_key_size = o->info->domain_attr->mr_key_size;
	attr->waits = wait ? 1 : 0;
	snprintf(attr->prov, sizeof attr->prov, "%s", o->info->fabric_attr->prov_name);
	snprintf(attr->fabric, sizeof attr->fabric, "%s", o->info->fabric_attr->name);
	*out = o;
	return 0;
}

void oxofi_close(struct oxofi *o)
{
	close_all(o);
}

int oxofi_av_insert(struct oxofi *o, const void *addr, uint64_t *fi_addr)
{
	fi_addr_t a = FI_ADDR_UNSPEC;
	int n = fi_av_insert(o->av, addr, 1, &a, 0, NULL);
	if (n != 1)
		return n < 0 ? n : -FI_EINVAL;
	*fi_addr = a;
	return 0;
}

/* Registers [buf, buf+len) for local and remote reads and writes. `key`: the requested key
 * (ignored under FI_MR_PROV_KEY); the key peers use comes back in `key_out`. */
int oxofi_mr_reg(struct oxofi *o, void *buf, size_t len, uint64_t key, struct fid_mr **mr,
		 void **desc, uint64_t *key_out)
{
	uint64_t access = FI_SEND | FI_RECV | FI_READ | FI_WRITE | FI_REMOTE_READ |
			  FI_REMOTE_WRITE;
	int ret = fi_mr_reg(o->domain, buf, len, access, 0, key, 0, mr, NULL);
	if (ret)
		return ret;
	if (o->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
		ret = fi_mr_bind(*mr, &o->ep->fid, 0);
		if (!ret)
			ret = fi_mr_enable(*mr);
		if (ret) {
			fi_close(&(*mr)->fid);
			return ret;
		}
	}
	*desc = fi_mr_desc(*mr);
	*key_out = fi_mr_key(*mr);
	return 0;
}

int oxofi_mr_close(struct fid_mr *mr)
{
	return fi_close(&mr->fid);
}

ssize_t oxofi_recv(struct oxofi *o, void *buf, size_t len, void *desc, void *ctx)
{
	return fi_recv(o->ep, buf, len, desc, FI_ADDR_UNSPEC, ctx);
}

ssize_t oxofi_send(struct oxofi *o, const void *buf, size_t len, void *desc, uint64_t dest,
		   void *ctx)
{
	return fi_send(o->ep, buf, len, desc, dest, ctx);
}

ssize_t oxofi_inject(struct oxofi *o, const void *buf, size_t len, uint64_t dest)
{
	return fi_inject(o->ep, buf, len, dest);
}

/* RMA read of `len` bytes at the peer's (addr, key) into local `buf`. */
ssize_t oxofi_read(struct oxofi *o, void *buf, size_t len, void *desc, uint64_t src,
		   uint64_t addr, uint64_t key, void *ctx)
{
	return fi_read(o->ep, buf, len, desc, src, addr, key, ctx);
}

/* RMA write of local `buf` to the peer's (addr, key), completing only once the data is
 * visible at the target (FI_DELIVERY_COMPLETE); with `with_data`, `data` is delivered to the
 * target's CQ as remote CQ data (fi_writedata semantics). */
ssize_t oxofi_write(struct oxofi *o, const void *buf, size_t len, void *desc, uint64_t dest,
		    uint64_t addr, uint64_t key, uint64_t data, int with_data, void *ctx)
{
	struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
	struct fi_rma_iov rma = {.addr = addr, .len = len, .key = key};
	struct fi_msg_rma msg = {
		.msg_iov = &iov,
		.desc = &desc,
		.iov_count = 1,
		.addr = dest,
		.rma_iov = &rma,
		.rma_iov_count = 1,
		.context = ctx,
		.data = data,
	};
	uint64_t flags = FI_COMPLETION | FI_DELIVERY_COMPLETE;
	if (with_data)
		flags |= FI_REMOTE_CQ_DATA;
	return fi_writemsg(o->ep, &msg, flags);
}

ssize_t oxofi_cq_read(struct oxofi *o, struct fi_cq_data_entry *buf, size_t n)
{
	return fi_cq_read(o->cq, buf, n);
}

ssize_t oxofi_cq_sread(struct oxofi *o, struct fi_cq_data_entry *buf, size_t n, int timeout_ms)
{
	return fi_cq_sread(o->cq, buf, n, NULL, timeout_ms);
}

int oxofi_cq_signal(struct oxofi *o)
{
	return fi_cq_signal(o->cq);
}

/* The error entry at the head of the CQ: its context, libfabric error, and the provider's
 * explanation in `msg`. */
ssize_t oxofi_cq_readerr(struct oxofi *o, void **ctx, int *err, uint64_t *flags, char *msg,
			 size_t msglen)
{
	struct fi_cq_err_entry e;
	memset(&e, 0, sizeof e);
	ssize_t n = fi_cq_readerr(o->cq, &e, 0);
	if (n != 1)
		return n;
	*ctx = e.op_context;
	*err = e.err;
	*flags = e.flags;
	const char *s = fi_cq_strerror(o->cq, e.prov_errno, e.err_data, NULL, 0);
	snprintf(msg, msglen, "%s (%s)", fi_strerror(e.err), s ? s : "");
	return 1;
}

const char *oxofi_strerror(int err)
{
	return fi_strerror(err);
}

/* libfabric pulls in libinfinipath and libpsm2 (its psm providers), whose load-time constructors
 * install handlers for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT that print a backtrace and
 * exit with status 1: a crash or abort() of any program using oxccl would no longer end by its
 * signal (no core dump, a wrong exit status). Run right after loading libfabric, this puts the
 * default back for the handlers that are theirs, leaving anyone else's. */
static void restore_signals(void) {
    static const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
    for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction old;
        if (sigaction(sigs[i], NULL, &old) != 0) {
            continue;
        }
        void *h = (old.sa_flags & SA_SIGINFO) ? (void *)old.sa_sigaction : (void *)old.sa_handler;
        if (h == (void *)SIG_DFL || h == (void *)SIG_IGN) {
            continue;
        }
        Dl_info info;
        if (dladdr(h, &info) && info.dli_fname &&
            (strstr(info.dli_fname, "infinipath") || strstr(info.dli_fname, "psm"))) {
            signal(sigs[i], SIG_DFL);
        }
    }
}
