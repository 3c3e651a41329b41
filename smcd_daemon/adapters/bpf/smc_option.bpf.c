// SPDX-License-Identifier: GPL-2.0-only
/*
 * SMC peer detection: the TCP experimental option of RFC 7609 (kind 254, length 6, magic
 * 0xE2D4C3D9) written on the SYN and SYN-ACK of connections smcd will handle, and the peer's
 * option recorded per socket so that smcd can decide before writing a CLC byte.
 *
 * Three programs, all attached to one cgroup v2 (every socket created below it is covered):
 *
 *   smc_setsockopt  cgroup/setsockopt.  An application that wants SMC on a socket says so with a
 *                   private setsockopt(SOL_SMCD, SMCD_OPT_WANT) before connect(); the program
 *                   records the wish in the socket's local storage and hides the call from the
 *                   kernel (without the program the kernel answers ENOPROTOOPT: "no detection").
 *   smc_getsockopt  cgroup/getsockopt.  getsockopt(SOL_SMCD, SMCD_OPT_STATE) answers the
 *                   socket's flags, so the library can ask what the peer showed.
 *   smc_sockops     sockops.  Writes and reads the option:
 *       TCP_CONNECT_CB     a wished-for socket asks for the header-option callbacks; no other
 *                          socket ever does, so a plain client's SYN is never touched.
 *       TCP_LISTEN_CB      every listener asks for them (registration with smcd usually comes
 *                          after listen()) and is marked "armed" so smcd can tell a listener
 *                          that predates the program.
 *       HDR_OPT_LEN_CB /   SYN of a wished-for socket: reserve and write the option.
 *       WRITE_HDR_OPT_CB   SYN-ACK: only if the listener's (netns, port) is registered by smcd
 *                          in smc_listeners AND the client's SYN carried the option; the
 *                          connection's 4-tuple goes into smc_synack_sent first, so the answer
 *                          given on the wire and the one recorded for the child agree.
 *       ACTIVE_ESTABLISHED the SYN-ACK that completed the handshake is searched for the
 *                          option: recorded in the client socket's storage (DONE, PEER).
 *       PASSIVE_ESTABLISHED the child of a registered listener records whether its SYN-ACK
 *                          carried the option (= the SYN did). Callbacks inherited from the
 *                          listener are switched off here, so data segments never run us.
 *
 * The kernel writes NOP NOP 254 6 magic; bpf_store_hdr_opt cannot store NOPs, so ours is
 * 254 6 magic NOP NOP (the kernel pads the reserved space with NOPs). Parsers, the kernel's
 * smc_parse_options among them, look for the option anywhere in the option list.
 *
 * Only uapi context fields and helpers present since Linux 5.18 are used (no CO-RE), so the same
 * object loads on Debian's 6.1 and on newer kernels.
 */
#include <linux/bpf.h>
#include <linux/types.h>
#include <bpf/bpf_helpers.h>

#define AF_INET 2
#define AF_INET6 10
#define IPPROTO_TCP 6
#define TCPHDR_SYN 0x02
#define TCPHDR_ACK 0x10
#define EEXIST 17

#define TCPOPT_EXP 254
#define SMC_OPT_LEN 6

/* The private setsockopt: level "SMC" in ASCII, far from any level the kernel knows. */
#define SOL_SMCD 0x534d43
#define SMCD_OPT_WANT 1
#define SMCD_OPT_STATE 2 /* getsockopt: the socket's flags (below) */

/* Per-socket flags (struct smc_sk.flags); the Python side mirrors these values. */
#define F_WANT 0x01  /* the application asked for SMC: our SYN carries the option */
#define F_SENT 0x02  /* our SYN / SYN-ACK carried the option */
#define F_PEER 0x04  /* the peer's SYN-ACK / SYN carried the option */
#define F_DONE 0x08  /* handshake complete: F_PEER is final */
#define F_ARMED 0x10 /* listener created while the program was attached */

struct smc_sk {
	__u32 flags;
};

struct listener_key {
	__u64 netns;
	__u32 port; /* host order */
	__u32 pad;
};

struct conn_key {
	__u64 netns;
	__u32 family;
	__u32 local_port;  /* as the ctx gives it (host order) */
	__u32 remote_port; /* as the ctx gives it (network order) */
	__u32 local_ip[4];
	__u32 remote_ip[4];
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct smc_sk);
} smc_sk_state SEC(".maps");

/* Filled by smcd: listeners whose SYN-ACKs may carry the option. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct listener_key);
	__type(value, __u8);
} smc_listeners SEC(".maps");

/*
 * Half-open connections whose SYN-ACK carried the option, until the child is established.
 * A plain hash, not an LRU: when it is full no SYN-ACK gets the option (the client then falls
 * back, as the server will), instead of an evicted entry making the two ends disagree. smcd
 * purges entries of handshakes that never completed (value: bpf_ktime_get_ns at the SYN-ACK).
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct conn_key);
	__type(value, __u64);
} smc_synack_sent SEC(".maps");

/*
 * Stack buffers are written in whole 8-byte words. smcd.service holds CAP_BPF and CAP_NET_ADMIN
 * but not CAP_PERFMON, and without it Linux 6.1's verifier refuses a second store of less than
 * 8 bytes into a stack slot that already holds a narrower register spill ("attempt to corrupt
 * spilled pointer on stack", even for plain numbers; newer kernels accept it). clang writes
 * struct members and byte arrays member by member, so the words are built in registers and
 * stored once; the empty asm keeps clang from splitting a word back into its halves.
 */
static __always_inline __u64 word(__u64 v)
{
	asm volatile("" : "+r"(v));
	return v;
}

/* Two 32-bit members that share one 8-byte word, the first at the lower address. */
static __always_inline __u64 pair32(__u32 first, __u32 second)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	return word((__u64)second << 32 | first);
#else
	return word((__u64)first << 32 | second);
#endif
}

/* The option's 6 bytes, zero-padded to a word (the helpers are given 6). */
union smc_opt {
	__u8 bytes[8];
	__u64 word;
};

static __always_inline void smc_option_bytes(union smc_opt *opt)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	opt->word = word(0x0000D9C3D4E206FEULL); /* fe 06 e2 d4 c3 d9: kind, length, magic */
#else
	opt->word = word(0xFE06E2D4C3D90000ULL);
#endif
}

/* Does the current packet (flags 0) or the SYN being answered (BPF_LOAD_HDR_OPT_TCP_SYN)
 * carry the SMC option? The search matches kind 254 with the 4-byte magic. */
static __always_inline int has_smc_option(struct bpf_sock_ops *skops, __u64 flags)
{
	union smc_opt opt;

	smc_option_bytes(&opt);
	return bpf_load_hdr_opt(skops, opt.bytes, SMC_OPT_LEN, flags) > 0;
}

static __always_inline int listener_registered(struct bpf_sock_ops *skops)
{
	struct listener_key key;
	__u64 *w = (__u64 *)&key; /* in words: see word() */

	w[0] = bpf_get_netns_cookie(skops);
	w[1] = pair32(skops->local_port, 0); /* port, pad */
	return bpf_map_lookup_elem(&smc_listeners, &key) != 0;
}

_Static_assert(sizeof(struct listener_key) == 2 * sizeof(__u64), "listener_key: 2 words");
_Static_assert(sizeof(struct conn_key) == 7 * sizeof(__u64), "conn_key: 7 words");

/* The members of struct conn_key, word by word (see word()). */
static __always_inline void fill_conn_key(struct bpf_sock_ops *skops, struct conn_key *key)
{
	__u64 *w = (__u64 *)key;
	__u32 family = skops->family;

	w[0] = bpf_get_netns_cookie(skops);
	w[1] = pair32(family, skops->local_port);
	if (family == AF_INET) {
		w[2] = pair32(skops->remote_port, skops->local_ip4);   /* local_ip[0] */
		w[3] = word(0);                                         /* local_ip[1], [2] */
		w[4] = pair32(0, skops->remote_ip4);                    /* local_ip[3], remote_ip[0] */
		w[5] = word(0);                                         /* remote_ip[1], [2] */
		w[6] = word(0);                                         /* remote_ip[3], pad */
	} else {
		w[2] = pair32(skops->remote_port, skops->local_ip6[0]);
		w[3] = pair32(skops->local_ip6[1], skops->local_ip6[2]);
		w[4] = pair32(skops->local_ip6[3], skops->remote_ip6[0]);
		w[5] = pair32(skops->remote_ip6[1], skops->remote_ip6[2]);
		w[6] = pair32(skops->remote_ip6[3], 0);
	}
}

static __always_inline struct smc_sk *wished(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct smc_sk *st;

	if (!sk)
		return 0;
	st = bpf_sk_storage_get(&smc_sk_state, sk, 0, 0);
	if (!st || !(st->flags & F_WANT))
		return 0;
	return st;
}

static __always_inline void hdr_opt_callbacks(struct bpf_sock_ops *skops, int on)
{
	__u32 flags = skops->bpf_sock_ops_cb_flags;

	if (on)
		flags |= BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG;
	else
		flags &= ~BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG;
	if (flags != skops->bpf_sock_ops_cb_flags)
		bpf_sock_ops_cb_flags_set(skops, flags);
}

/* SYN-ACK of a registered listener answering a SYN that carried the option. */
static __always_inline int synack_wanted(struct bpf_sock_ops *skops)
{
	return listener_registered(skops) && has_smc_option(skops, BPF_LOAD_HDR_OPT_TCP_SYN);
}

static __always_inline void on_hdr_opt_len(struct bpf_sock_ops *skops)
{
	__u32 tcp_flags = skops->skb_tcp_flags;

	if (!(tcp_flags & TCPHDR_SYN))
		return;
	if (tcp_flags & TCPHDR_ACK) {
		if (!synack_wanted(skops))
			return;
	} else if (!wished(skops)) {
		return;
	}
	bpf_reserve_hdr_opt(skops, SMC_OPT_LEN, 0);
}

static __always_inline void on_write_hdr_opt(struct bpf_sock_ops *skops)
{
	__u32 tcp_flags = skops->skb_tcp_flags;
	union smc_opt opt;
	struct conn_key key;
	struct smc_sk *st;
	__u64 now;
	long err;

	if (!(tcp_flags & TCPHDR_SYN))
		return;
	smc_option_bytes(&opt);
	if (!(tcp_flags & TCPHDR_ACK)) {
		st = wished(skops);
		if (!st)
			return;
		err = bpf_store_hdr_opt(skops, opt.bytes, SMC_OPT_LEN, 0);
		if (err == 0 || err == -EEXIST)
			st->flags |= F_SENT;
		return;
	}
	if (!synack_wanted(skops))
		return;
	/* Record first: an option on the wire without a record would make the ends disagree. */
	fill_conn_key(skops, &key);
	now = bpf_ktime_get_ns();
	if (bpf_map_update_elem(&smc_synack_sent, &key, &now, BPF_ANY))
		return;
	err = bpf_store_hdr_opt(skops, opt.bytes, SMC_OPT_LEN, 0);
	if (err && err != -EEXIST)
		bpf_map_delete_elem(&smc_synack_sent, &key);
}

static __always_inline void on_active_established(struct bpf_sock_ops *skops)
{
	struct smc_sk *st = wished(skops);

	if (!st)
		return;
	/* skb_data here is the SYN-ACK that concluded the handshake. */
	st->flags |= F_DONE | (has_smc_option(skops, 0) ? F_PEER : 0);
	hdr_opt_callbacks(skops, 0);
}

static __always_inline void on_passive_established(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct conn_key key;
	struct smc_sk *st;
	__u32 flags;

	hdr_opt_callbacks(skops, 0); /* inherited from the listener */
	if (!sk)
		return;
	fill_conn_key(skops, &key);
	if (bpf_map_lookup_elem(&smc_synack_sent, &key)) {
		bpf_map_delete_elem(&smc_synack_sent, &key);
		flags = F_DONE | F_SENT | F_PEER;
	} else if (listener_registered(skops)) {
		flags = F_DONE;
	} else {
		return;
	}
	st = bpf_sk_storage_get(&smc_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (st)
		st->flags = flags;
}

SEC("sockops")
int smc_sockops(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk;
	struct smc_sk *st;

	switch (skops->op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		if (wished(skops))
			hdr_opt_callbacks(skops, 1);
		break;
	case BPF_SOCK_OPS_TCP_LISTEN_CB:
		sk = skops->sk;
		if (!sk)
			break;
		st = bpf_sk_storage_get(&smc_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
		if (st)
			st->flags |= F_ARMED;
		hdr_opt_callbacks(skops, 1);
		break;
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
		on_hdr_opt_len(skops);
		break;
	case BPF_SOCK_OPS_WRITE_HDR_OPT_CB:
		on_write_hdr_opt(skops);
		break;
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		on_active_established(skops);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		on_passive_established(skops);
		break;
	}
	return 1;
}

SEC("cgroup/setsockopt")
int smc_setsockopt(struct bpf_sockopt *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	struct smc_sk *st;

	if (ctx->level != SOL_SMCD || ctx->optname != SMCD_OPT_WANT)
		return 1; /* not ours: the kernel handles it (ENOPROTOOPT for unknown SOL_SMCD) */
	/* Only a TCP socket not yet connected can still put the option on its SYN. */
	if (!sk || sk->protocol != IPPROTO_TCP || sk->state != BPF_TCP_CLOSE)
		return 0; /* EPERM */
	st = bpf_sk_storage_get(&smc_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return 0;
	st->flags |= F_WANT;
	ctx->optlen = -1; /* handled here: the kernel's setsockopt does not run */
	return 1;
}

/*
 * The library's own question, asked when it falls back without the daemon (none running, a
 * full handoff queue, a daemon lost before it read the request): did the peer show the option
 * (then it waits for CLC and must get a Decline first)? getsockopt(SOL_SMCD, SMCD_OPT_STATE)
 * answers the socket's flags as a __u32 (0: nothing recorded). Without the program the kernel's
 * ENOPROTOOPT stands. Any other getsockopt passes through untouched.
 */
SEC("cgroup/getsockopt")
int smc_getsockopt(struct bpf_sockopt *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	__u8 *optval = ctx->optval;
	__u8 *optval_end = ctx->optval_end;
	struct smc_sk *st;

	if (ctx->level != SOL_SMCD || ctx->optname != SMCD_OPT_STATE)
		return 1; /* not ours: the kernel's answer stands */
	if (!sk || optval + sizeof(__u32) > optval_end)
		return 1;
	st = bpf_sk_storage_get(&smc_sk_state, sk, 0, 0);
	*(__u32 *)optval = st ? st->flags : 0;
	ctx->optlen = sizeof(__u32);
	/* two 32-bit context stores, never merged into one 64-bit store (the verifier refuses) */
	asm volatile("" ::: "memory");
	ctx->retval = 0;
	return 1;
}

char LICENSE[] SEC("license") = "GPL";
