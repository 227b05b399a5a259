// Command csi-node-driver-registrar stands in for
// github.com/kubernetes-csi/node-driver-registrar, which the Go module proxy reachable from the
// project's machines does not serve. It does what the kubelet needs of the upstream one: asks
// the plugin its name (GetPluginInfo), serves the kubelet plugin-registration API on
// <registration dir>/<name>-reg.sock, exits when the kubelet reports a failed registration,
// and answers /healthz once registered.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

type registrar struct {
	registerapi.UnimplementedRegistrationServer
	name       string
	endpoint   string
	registered atomic.Bool
}

func (r *registrar) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.name,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (r *registrar) NotifyRegistrationStatus(_ context.Context, status *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !status.PluginRegistered {
		// Upstream exits too, so that the kubelet restarts the container and registration is
		// retried from scratch.
		log.Fatalf("registration failed: %s", status.Error)
	}
	r.registered.Store(true)
	log.Printf("registered %s with the kubelet", r.name)
	return &registerapi.RegistrationStatusResponse{}, nil
}

func main() {
	address := flag.String("csi-address", "/run/csi/socket", "CSI endpoint (Unix socket path) inside this container")
	kubeletPath := flag.String("kubelet-registration-path", "", "the same socket's path on the host, as the kubelet sees it")
	registrationDir := flag.String("plugin-registration-path", "/registration", "the kubelet's plugins_registry directory")
	endpoint := flag.String("http-endpoint", "", "address of the /healthz server (none when empty)")
	timeout := flag.Duration("timeout", 15*time.Second, "timeout of the GetPluginInfo call")
	flag.Int("v", 0, "log verbosity (accepted for compatibility)")
	flag.Parse()
	if *kubeletPath == "" {
		log.Fatal("--kubelet-registration-path is required")
	}

	target := "unix://" + strings.TrimPrefix(*address, "unix://")
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("cannot connect to %s: %v", target, err)
	}
	var name string
	for {
		ctx, cancel := context.WithTimeout(context.Background(), *timeout)
		info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		cancel()
		if err == nil {
			name = info.GetName()
			break
		}
		log.Printf("GetPluginInfo on %s: %v (retrying)", target, err)
		time.Sleep(time.Second)
	}
	conn.Close()

	r := &registrar{name: name, endpoint: *kubeletPath}
	socket := filepath.Join(*registrationDir, name+"-reg.sock")
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		log.Fatalf("cannot remove the stale %s: %v", socket, err)
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		log.Fatalf("cannot listen on %s: %v", socket, err)
	}
	server := grpc.NewServer()
	registerapi.RegisterRegistrationServer(server, r)

	if *endpoint != "" {
		http.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
			if _, err := os.Stat(socket); err != nil || !r.registered.Load() {
				w.WriteHeader(http.StatusInternalServerError)
				fmt.Fprintf(w, "not registered (socket %s)", socket)
				return
			}
			fmt.Fprint(w, "ok")
		})
		go func() { log.Fatal(http.ListenAndServe(*endpoint, nil)) }()
	}

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		server.Stop()
		os.Remove(socket)
		os.Exit(0)
	}()
	log.Printf("serving registration of %s (endpoint %s) on %s", name, *kubeletPath, socket)
	if err := server.Serve(listener); err != nil {
		log.Fatalf("serving %s: %v", socket, err)
	}
}
