// Command livenessprobe stands in for github.com/kubernetes-csi/livenessprobe, which the Go
// module proxy reachable from the project's machines does not serve. It keeps the upstream
// flags the chart passes and the upstream behaviour the kubelet sees: GET /healthz calls the
// plugin's Identity.Probe and answers 200 only when the plugin says it is ready.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	address := flag.String("csi-address", "/run/csi/socket", "CSI endpoint (Unix socket path)")
	endpoint := flag.String("http-endpoint", "", "address of the /healthz server (default :<health-port>)")
	port := flag.Int("health-port", 9808, "port of the /healthz server when --http-endpoint is empty")
	timeout := flag.Duration("probe-timeout", time.Second, "timeout of each Probe call")
	flag.Int("v", 0, "log verbosity (accepted for compatibility)")
	flag.String("metrics-address", "", "accepted for compatibility, unused")
	flag.Parse()
	if *endpoint == "" {
		*endpoint = ":" + strconv.Itoa(*port)
	}
	target := "unix://" + strings.TrimPrefix(*address, "unix://")
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("cannot connect to %s: %v", target, err)
	}
	identity := csi.NewIdentityClient(conn)
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), *timeout)
		defer cancel()
		resp, err := identity.Probe(ctx, &csi.ProbeRequest{})
		if err != nil {
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprintf(w, "probe failed: %v", err)
			log.Printf("health check failed: %v", err)
			return
		}
		if ready := resp.GetReady(); ready != nil && !ready.GetValue() {
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprint(w, "driver is not ready")
			return
		}
		fmt.Fprint(w, "ok")
	})
	log.Printf("serving /healthz on %s, probing %s", *endpoint, target)
	log.Fatal(http.ListenAndServe(*endpoint, nil))
}
