//go:build tools

// Package tools records the command `cargo xtask cluster` builds, so that `go mod tidy` keeps
// its dependencies in go.sum.
package tools

import _ "go.etcd.io/etcd/server/v3"
