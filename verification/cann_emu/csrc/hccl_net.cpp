// The HCCL emulation's transport: TCP on 127.0.0.1. Every blocking step polls with the caller's
// deadline, so a peer that never comes fails with HCCL_E_TIMEOUT and one whose process ended (its
// sockets closed by the kernel) with HCCL_E_TCP_TRANSFER, both naming the peer.
#include "cann_emu.h"
#include "hccl_internal.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <atomic>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace cann_emu::hccl {
namespace {

std::string sys_error(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

std::atomic<uint64_t> g_aborts{0};          // aclrtDeviceTaskAbort calls so far
thread_local uint64_t t_aborts_at_start = 0;  // g_aborts when this thread's current HCCL call started

int remaining_ms(Clock::time_point deadline) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return ms <= 0 ? 0 : ms > 1000 ? 1000 : int(ms);  // wake at least each second to re-check
}


void tune(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    fcntl(fd, F_SETFD, FD_CLOEXEC);
}

sockaddr_in loopback(int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
}

}  // namespace

void start_call() { t_aborts_at_start = g_aborts.load(); }
void check_aborted(const std::string& what) {
    if (g_aborts.load() != t_aborts_at_start)
        raise(HCCL_E_INTERNAL, what + ": aborted by aclrtDeviceTaskAbort (the device's tasks were stopped)");
}
void abort_calls() { g_aborts.fetch_add(1); }

void close_fd(int fd) {
    if (fd >= 0) ::close(fd);
}

int listen_loopback(int* port) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) raise(HCCL_E_SYSCALL, sys_error("socket"));
    sockaddr_in addr = loopback(0);
    socklen_t len = sizeof(addr);
    if (::bind(fd, (sockaddr*)&addr, sizeof(addr)) != 0 || ::listen(fd, 256) != 0 ||
        ::getsockname(fd, (sockaddr*)&addr, &len) != 0) {
        std::string e = sys_error("bind/listen on 127.0.0.1");
        ::close(fd);
        raise(HCCL_E_SYSCALL, e);
    }
    *port = ntohs(addr.sin_port);
    return fd;
}

int connect_loopback(int port, Clock::time_point deadline, const std::string& what) {
    for (;;) {
        int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) raise(HCCL_E_SYSCALL, sys_error("socket"));
        sockaddr_in addr = loopback(port);
        if (::connect(fd, (sockaddr*)&addr, sizeof(addr)) == 0) {
            tune(fd);
            return fd;
        }
        int err = errno;
        ::close(fd);
        if (Clock::now() >= deadline)
            raise(HCCL_E_TCP_CONNECT, "could not connect to " + what + " at 127.0.0.1:" + std::to_string(port) +
                                          " before the timeout (" + std::strerror(err) + ")");
        check_aborted("connecting to " + what);
        ::usleep(20000);  // the listener is made before the root info is shared; refused means gone or not yet
    }
}

int accept_one(int listen_fd, Clock::time_point deadline, const std::string& what) {
    for (;;) {
        check_aborted(what + " to connect");
        pollfd p{listen_fd, POLLIN, 0};
        int n = ::poll(&p, 1, std::min(remaining_ms(deadline), kAbortPollMs));
        if (n < 0 && errno != EINTR) raise(HCCL_E_SYSCALL, sys_error("poll"));
        if (n > 0) {
            int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
            if (fd >= 0) {
                tune(fd);
                return fd;
            }
            if (errno != EINTR && errno != EAGAIN) raise(HCCL_E_SYSCALL, sys_error("accept"));
        }
        if (Clock::now() >= deadline) {
            char limit[64];
            std::snprintf(limit, sizeof(limit), "%g s", config().hccl_timeout_s);
            raise(HCCL_E_TIMEOUT, "waited " + std::string(limit) + " (CANN_EMU_HCCL_TIMEOUT) for " + what + " to connect");
        }
    }
}

void pump(std::vector<Lane>& lanes, Clock::time_point deadline, const std::string& what) {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (;;) {
        fds.clear();
        which.clear();
        for (size_t i = 0; i < lanes.size(); ++i) {
            Lane& l = lanes[i];
            while (!l.parts.empty() && l.parts.front().len == 0) {  // empty parts complete at once
                auto done = std::move(l.parts.front().done);
                l.parts.pop_front();
                if (done) done();
            }
            if (l.parts.empty()) continue;
            fds.push_back({l.fd, short(l.send ? POLLOUT : POLLIN), 0});
            which.push_back(i);
        }
        if (fds.empty()) return;
        if (Clock::now() >= deadline) {
            std::string waiting;
            for (size_t i : which)
                waiting += (waiting.empty() ? "" : ", ") + std::string(lanes[i].send ? "sending to " : "receiving from ") +
                           lanes[i].peer;
            char limit[64];
            std::snprintf(limit, sizeof(limit), "%g s", config().hccl_timeout_s);
            raise(HCCL_E_TIMEOUT, what + " timed out after " + limit + " (CANN_EMU_HCCL_TIMEOUT) while " + waiting);
        }
        check_aborted(what);
        int n = ::poll(fds.data(), fds.size(), std::min(remaining_ms(deadline), kAbortPollMs));
        if (n < 0) {
            if (errno == EINTR) continue;
            raise(HCCL_E_SYSCALL, sys_error("poll"));
        }
        for (size_t k = 0; k < fds.size(); ++k) {
            if (!fds[k].revents) continue;
            Lane& l = lanes[which[k]];
            Part& part = l.parts.front();
            ssize_t got = l.send ? ::send(l.fd, part.ptr + l.off, part.len - l.off, MSG_DONTWAIT | MSG_NOSIGNAL)
                                 : ::recv(l.fd, part.ptr + l.off, part.len - l.off, MSG_DONTWAIT);
            if (got < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
                raise(HCCL_E_TCP_TRANSFER, what + ": " + l.peer + " closed its connection (" + std::strerror(errno) +
                                               "; its process exited or destroyed the communicator)");
            }
            if (got == 0 && !l.send)
                raise(HCCL_E_TCP_TRANSFER, what + ": " + l.peer +
                                               " closed its connection (its process exited or destroyed the communicator)");
            l.off += size_t(got);
            if (l.off == part.len) {
                auto done = std::move(part.done);
                l.parts.pop_front();
                l.off = 0;
                if (done) done();
            }
        }
    }
}

}  // namespace cann_emu::hccl
