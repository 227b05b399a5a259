/* The sandbox ("pause") image of `cargo xtask cluster`: holds a pod's namespaces, reaps the
 * orphans reparented to it (it is pid 1 of the pod when the pod shares its pid namespace), and
 * exits on SIGINT or SIGTERM. Built with `gcc -static`, so the image is this one file. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { _exit(128 + sig); }

static void reap(int sig) {
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
}

int main(void) {
	struct sigaction sa = {0};
	sa.sa_handler = stop;
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	sa.sa_handler = reap;
	sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
	sigaction(SIGCHLD, &sa, NULL);
	for (;;)
		pause();
	return EXIT_FAILURE;
}
