/* A delay line for the lab's links on kernels without netem: holds every packet of some netfilter queues
 * for a fixed time, then lets it through.
 *
 *     delayline QUEUE:MICROSECONDS [QUEUE:MICROSECONDS ...]
 *
 * Run inside a lab host's network namespace, with iptables rules there sending packets to the queues
 * (``-j NFQUEUE --queue-num QUEUE --queue-bypass``; ``tests/lab/netlab.py`` sets them up). For each packet the
 * kernel queues, this program learns only its id (``NFQNL_COPY_META``: no payload is copied; ``NFQA_CFG_F_GSO``:
 * a GSO packet is queued whole, not segmented first) and gives the verdict ACCEPT once the packet has waited
 * its queue's delay. A queue's packets wait the same time, so they leave in the order they came, and one
 * batch verdict (``NFQNL_MSG_VERDICT_BATCH``: every id up to one) lets through all that are due.
 *
 * Fail-open (``NFQA_CFG_F_FAIL_OPEN``): a packet that finds the queue full passes undelayed rather than
 * being dropped. The program ends on SIGTERM or SIGINT; the rules' --queue-bypass then passes packets.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_QUEUES 8
#define RING 131072 /* packets held per queue at most (the kernel's queue is as long) */
#define BUF_BYTES (1 << 20)

struct held {
    uint32_t id;
    int64_t due_ns;
};

struct queue {
    uint16_t num;
    int64_t delay_ns;
    struct held ring[RING];
    size_t head, count;
};

static struct queue queues[MAX_QUEUES];
static int n_queues;
static volatile sig_atomic_t stop;

static void on_signal(int sig) { (void)sig; stop = 1; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "delayline: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* Append attribute ``type`` with ``len`` bytes of ``data`` to the message at ``msg``. */
static void put_attr(struct nlmsghdr *msg, uint16_t type, const void *data, uint16_t len) {
    struct nlattr *attr = (struct nlattr *)((char *)msg + NLMSG_ALIGN(msg->nlmsg_len));
    attr->nla_type = type;
    attr->nla_len = NLA_HDRLEN + len;
    memcpy((char *)attr + NLA_HDRLEN, data, len);
    msg->nlmsg_len = NLMSG_ALIGN(msg->nlmsg_len) + NLA_ALIGN(attr->nla_len);
}

static struct nlmsghdr *start_msg(char *buf, uint8_t type, uint16_t queue, uint16_t flags) {
    memset(buf, 0, 256);
    struct nlmsghdr *msg = (struct nlmsghdr *)buf;
    msg->nlmsg_len = NLMSG_LENGTH(sizeof(struct nfgenmsg));
    msg->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | type;
    msg->nlmsg_flags = NLM_F_REQUEST | flags;
    struct nfgenmsg *gen = NLMSG_DATA(msg);
    gen->nfgen_family = AF_UNSPEC;
    gen->version = NFNETLINK_V0;
    gen->res_id = htons(queue);
    return msg;
}

static void send_msg(int fd, struct nlmsghdr *msg) {
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    if (sendto(fd, msg, msg->nlmsg_len, 0, (struct sockaddr *)&kernel, sizeof kernel) < 0) die("sendto");
}

/* Send a configuration request and wait for its acknowledgement (an error ends the program). */
static void configure(int fd, struct nlmsghdr *msg) {
    send_msg(fd, msg);
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0) die("recv (configuration)");
    struct nlmsghdr *reply = (struct nlmsghdr *)buf;
    if (reply->nlmsg_type == NLMSG_ERROR) {
        struct nlmsgerr *err = NLMSG_DATA(reply);
        if (err->error) {
            errno = -err->error;
            die("binding the queue");
        }
    }
}

static void bind_queue(int fd, uint16_t num) {
    char buf[256];
    struct nlmsghdr *msg = start_msg(buf, NFQNL_MSG_CONFIG, num, NLM_F_ACK);
    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND, .pf = htons(AF_INET)};
    put_attr(msg, NFQA_CFG_CMD, &cmd, sizeof cmd);
    configure(fd, msg);

    msg = start_msg(buf, NFQNL_MSG_CONFIG, num, NLM_F_ACK);
    struct nfqnl_msg_config_params params = {.copy_range = htonl(0), .copy_mode = NFQNL_COPY_META};
    put_attr(msg, NFQA_CFG_PARAMS, &params, sizeof params);
    uint32_t maxlen = htonl(RING);
    put_attr(msg, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof maxlen);
    uint32_t flags = htonl(NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO);
    put_attr(msg, NFQA_CFG_MASK, &flags, sizeof flags);
    put_attr(msg, NFQA_CFG_FLAGS, &flags, sizeof flags);
    configure(fd, msg);
}

static struct queue *find_queue(uint16_t num) {
    for (int i = 0; i < n_queues; i++)
        if (queues[i].num == num) return &queues[i];
    return NULL;
}

/* Hold the packet of one NFQNL_MSG_PACKET message until its queue's delay has passed. */
static void hold(struct nlmsghdr *msg, int64_t now) {
    struct nfgenmsg *gen = NLMSG_DATA(msg);
    struct queue *q = find_queue(ntohs(gen->res_id));
    if (q == NULL) return;
    int left = (int)msg->nlmsg_len - NLMSG_LENGTH(sizeof *gen);
    struct nlattr *attr = (struct nlattr *)((char *)gen + NLMSG_ALIGN(sizeof *gen));
    while (left >= NLA_HDRLEN && attr->nla_len >= NLA_HDRLEN && attr->nla_len <= left) {
        if ((attr->nla_type & NLA_TYPE_MASK) == NFQA_PACKET_HDR) {
            struct nfqnl_msg_packet_hdr *hdr = (void *)((char *)attr + NLA_HDRLEN);
            if (q->count == RING) return; /* cannot happen: the kernel's queue is no longer than the ring */
            struct held *h = &q->ring[(q->head + q->count) % RING];
            h->id = ntohl(hdr->packet_id);
            h->due_ns = now + q->delay_ns;
            q->count++;
            return;
        }
        left -= NLA_ALIGN(attr->nla_len);
        attr = (struct nlattr *)((char *)attr + NLA_ALIGN(attr->nla_len));
    }
}

/* Let through every packet that is due: one batch verdict per queue. */
static void release(int fd, int64_t now) {
    for (int i = 0; i < n_queues; i++) {
        struct queue *q = &queues[i];
        uint32_t last = 0;
        int any = 0;
        while (q->count && q->ring[q->head].due_ns <= now) {
            last = q->ring[q->head].id;
            any = 1;
            q->head = (q->head + 1) % RING;
            q->count--;
        }
        if (!any) continue;
        char buf[256];
        struct nlmsghdr *msg = start_msg(buf, NFQNL_MSG_VERDICT_BATCH, q->num, 0);
        struct nfqnl_msg_verdict_hdr verdict = {.verdict = htonl(NF_ACCEPT), .id = htonl(last)};
        put_attr(msg, NFQA_VERDICT_HDR, &verdict, sizeof verdict);
        send_msg(fd, msg);
    }
}

static int64_t next_due(void) {
    int64_t due = -1;
    for (int i = 0; i < n_queues; i++) {
        struct queue *q = &queues[i];
        if (q->count && (due < 0 || q->ring[q->head].due_ns < due)) due = q->ring[q->head].due_ns;
    }
    return due;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc - 1 > MAX_QUEUES) {
        fprintf(stderr, "usage: delayline QUEUE:MICROSECONDS [QUEUE:MICROSECONDS ...] (at most %d)\n",
                MAX_QUEUES);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        unsigned num;
        double us;
        if (sscanf(argv[i], "%u:%lf", &num, &us) != 2 || num > 65535 || us < 0) {
            fprintf(stderr, "delayline: bad QUEUE:MICROSECONDS %s\n", argv[i]);
            return 2;
        }
        queues[n_queues].num = (uint16_t)num;
        queues[n_queues].delay_ns = (int64_t)(us * 1000);
        n_queues++;
    }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);

    int fd = socket(AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER);
    if (fd < 0) die("socket");
    int size = 16 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size);
    int one = 1;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sockaddr_nl self = {.nl_family = AF_NETLINK};
    if (bind(fd, (struct sockaddr *)&self, sizeof self) < 0) die("bind");
    for (int i = 0; i < n_queues; i++) bind_queue(fd, queues[i].num);
    printf("delayline: ready\n");
    fflush(stdout);

    static char buf[BUF_BYTES];
    while (!stop) {
        int64_t due = next_due(), now = now_ns();
        struct timespec wait, *timeout = NULL;
        if (due >= 0) {
            int64_t ns = due > now ? due - now : 0;
            wait.tv_sec = ns / 1000000000;
            wait.tv_nsec = ns % 1000000000;
            timeout = &wait;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int ready = ppoll(&pfd, 1, timeout, NULL);
        if (ready < 0 && errno != EINTR) die("ppoll");
        if (ready > 0) {
            for (;;) {
                ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
                if (n < 0) {
                    if (errno == EAGAIN || errno == EINTR || errno == ENOBUFS) break;
                    die("recv");
                }
                int64_t arrived = now_ns();
                for (struct nlmsghdr *msg = (struct nlmsghdr *)buf; NLMSG_OK(msg, n); msg = NLMSG_NEXT(msg, n))
                    if ((msg->nlmsg_type & 0xff) == NFQNL_MSG_PACKET &&
                        (msg->nlmsg_type >> 8) == NFNL_SUBSYS_QUEUE)
                        hold(msg, arrived);
            }
        }
        release(fd, now_ns());
    }
    return 0;
}
