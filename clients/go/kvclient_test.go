package kvclient_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvclient "github.com/kvservice/kvservice/clients/go"
	pb "github.com/kvservice/kvservice/clients/go/kvservicev1"
)

// liveService starts a real kvservice (KVCLIENT_TEST_SERVICE, default the repo's .venv) on a
// temp socket; extra flags are passed on.
func liveService(t *testing.T, extra ...string) string {
	t.Helper()
	bin := os.Getenv("KVCLIENT_TEST_SERVICE") // not KVSERVICE_*: the service rejects unknown options
	if bin == "" {
		bin, _ = filepath.Abs("../../.venv/bin/kvservice")
	}
	if _, err := os.Stat(bin); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("no kvservice at %s (run scripts/setup.sh)", bin)
		}
		t.Skipf("no kvservice at %s (run scripts/setup.sh)", bin)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "kv.sock")
	cmd := exec.Command(bin, append([]string{"serve", "--uds-path", sock, "--log-format", "text"}, extra...)...)
	out, _ := cmd.StdoutPipe()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Signal(os.Interrupt); _ = cmd.Wait() })
	ready, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "kvservice listening") {
				close(ready)
			}
		}
	}()
	select {
	case <-ready:
	case <-exited:
		t.Fatalf("kvservice exited at start; its stderr:\n%s", stderr.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("kvservice did not start within 60 s; its stderr:\n%s", stderr.String())
	}
	return "unix:" + sock
}

// engine registers a shm pool (one layer, 8 pages of 16 tokens) and publishes the given tokens.
func engine(t *testing.T, ctx context.Context, c *kvclient.Client, s *kvclient.Session, id string, tokens []uint32) string {
	t.Helper()
	name := fmt.Sprintf("kvgo-%d-%s", os.Getpid(), id)
	const pageBytes, pages = 16 * 1 * 8 * 2, 8
	if err := os.WriteFile("/dev/shm/"+name, make([]byte, 2*pageBytes*pages), 0o600); err != nil {
		t.Skipf("no POSIX shm here: %v", err)
	}
	t.Cleanup(func() { _ = os.Remove("/dev/shm/" + name) })
	region := func(off uint64) *pb.Region {
		return &pb.Region{Memory: &pb.Region_Shm{Shm: &pb.ShmMemory{Name: name, Offset: off}}, SizeBytes: pageBytes * pages}
	}
	layout := &pb.Layout{Kind: pb.BufferKind_BUFFER_KIND_MHA, NumLayers: 1, PageSize: 16, NumPages: pages,
		TotalKvHeads: 1, LocalKvHeads: 1, HeadDimK: 8, HeadDimV: 8, Dtype: pb.DType_DTYPE_FLOAT16, TpSize: 1}
	sctx := kvclient.WithSession(ctx, s)
	r, err := c.Raw().RegisterBuffers(sctx, &pb.RegisterBuffersRequest{Layout: layout,
		KRegions: []*pb.Region{region(0)}, VRegions: []*pb.Region{region(pageBytes * pages)}, EngineId: id})
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4*len(tokens))
	for i, v := range tokens {
		buf[4*i], buf[4*i+1], buf[4*i+2], buf[4*i+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
	}
	idx := make([]uint32, len(tokens)/16)
	for i := range idx {
		idx[i] = uint32(i)
	}
	if _, err := c.Raw().PublishPages(sctx, &pb.PublishPagesRequest{BufferSetId: r.BufferSetId,
		Key: &pb.PublishPagesRequest_Tokens{Tokens: &pb.TokenIds{U32Le: buf}}, PageIndices: idx}); err != nil {
		t.Fatal(err)
	}
	return r.BufferSetId
}

func TestRouterPicksTheDecodeEngineWithTheLongestPrefix(t *testing.T) {
	addr := liveService(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := kvclient.Dial(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if ok, err := c.Healthy(ctx); err != nil || !ok {
		t.Fatalf("health: %v %v", ok, err)
	}
	s, err := c.OpenSession(ctx, "go-router-test")
	if err != nil {
		t.Fatal(err)
	}
	prompt := make([]uint32, 96)
	for i := range prompt {
		prompt[i] = uint32(1000 + i)
	}
	engine(t, ctx, c, s, "decode-a", prompt[:32])        // 2 pages of the prompt
	bsB := engine(t, ctx, c, s, "decode-b", prompt[:80]) // 5 pages

	m, err := c.MatchPrefix(ctx, kvclient.Tokens(prompt), 16, kvclient.MatchOptions{ScoresOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	best := m.Best()
	if best == nil || best.EngineID != "decode-b" || best.MatchedPages != 5 || m.QueryPages != 6 {
		t.Fatalf("best = %+v of %+v", best, m)
	}

	leased, err := c.MatchPrefix(kvclient.WithSession(ctx, s), kvclient.Tokens(prompt), 16,
		kvclient.MatchOptions{BufferSetIDs: []string{bsB}, LeaseTTL: 30 * time.Second})
	if err != nil || leased.LeaseID == "" || len(leased.Matches[0].PageIndices) != 5 {
		t.Fatalf("lease: %+v %v", leased, err)
	}
	if err := c.ReleaseLease(kvclient.WithSession(ctx, s), leased.LeaseID); err != nil {
		t.Fatal(err)
	}
	if _, err := c.MatchPrefix(ctx, kvclient.Tokens(prompt), 16, kvclient.MatchOptions{LeaseTTL: time.Second}); err == nil {
		t.Fatal("a lease without a session must be refused")
	}

	// A transfer declared into decode-b, watched, then aborted: the watch sees ABORTED.
	sctx := kvclient.WithSession(ctx, s)
	if _, err := c.Raw().ExpectDelta(sctx, &pb.ExpectDeltaRequest{TransferId: "go-t1", BufferSetId: bsB,
		DstPageIndices: []uint32{6}, DeadlineMs: 30000}); err != nil {
		t.Fatal(err)
	}
	declared, err := c.MatchPrefix(ctx, kvclient.Tokens(prompt), 16, kvclient.MatchOptions{BufferSetIDs: []string{bsB}})
	if err != nil || declared.Matches[0].Load.InboundTransfers != 1 || declared.Matches[0].Load.InboundBytesPending == 0 ||
		!declared.Matches[0].Load.Admits || declared.BestAdmitting() == nil {
		t.Fatalf("load after ExpectDelta: %+v %v", declared, err)
	}
	go func() {
		time.Sleep(200 * time.Millisecond)
		_, _ = c.Raw().Abort(sctx, &pb.AbortRequest{TransferId: "go-t1", Reason: "router changed its mind"})
	}()
	var last pb.TransferState
	err = c.WatchTransfers(ctx, s, []string{"go-t1"}, func(st *pb.TransferStatus) bool {
		last = st.State
		return st.State == pb.TransferState_TRANSFER_STATE_PENDING || st.State == pb.TransferState_TRANSFER_STATE_TRANSFERRING
	})
	if err != nil || last != pb.TransferState_TRANSFER_STATE_ABORTED {
		t.Fatalf("watch: last state %v, err %v", last, err)
	}

	st, err := c.Stats(kvclient.WithSession(ctx, s)) // a session sees its own buffer sets
	if err != nil || len(st.BufferSets) != 2 || st.Index.Entries != 7 {
		t.Fatalf("stats: %v %v", st, err)
	}
	if err := c.CloseSession(ctx, s); err != nil {
		t.Fatal(err)
	}
	st, _ = c.Stats(ctx)
	if st.Index.Entries != 0 || st.Sessions != 0 {
		t.Fatalf("closing the session must release its buffer sets: %d pages indexed, %d sessions", st.Index.Entries, st.Sessions)
	}
}

// freePort is a TCP port free right now on 127.0.0.1.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// A router on TCP: refused without the bearer token, served with it (re-read from its file).
func TestRouterOverTCPNeedsTheBearerToken(t *testing.T) {
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("router-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	liveService(t, "--tcp-address", fmt.Sprintf("127.0.0.1:%d", port), "--token-file", token)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	target := fmt.Sprintf("127.0.0.1:%d", port)
	key := kvclient.Tokens(make([]uint32, 32))

	anon, err := kvclient.Dial(target)
	if err != nil {
		t.Fatal(err)
	}
	defer anon.Close()
	if _, err := anon.MatchPrefix(ctx, key, 16, kvclient.MatchOptions{}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("without a token: %v, want UNAUTHENTICATED", err)
	}
	if ok, err := anon.Healthy(ctx); err != nil || !ok { // probes need no credential
		t.Fatalf("health without a token: %v %v", ok, err)
	}
	c, err := kvclient.Dial(target, kvclient.WithBearerTokenFile(token))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.MatchPrefix(ctx, key, 16, kvclient.MatchOptions{}); err != nil {
		t.Fatalf("with the token: %v", err)
	}
}

// A router on TCP with mutual TLS: a certificate of the service's client CA is required.
func TestRouterOverMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca := newTestCA(t, dir)
	srvCert, srvKey := ca.leaf(t, dir, "kvservice")
	cliCert, cliKey := ca.leaf(t, dir, "router")
	port := freePort(t)
	liveService(t, "--tcp-address", fmt.Sprintf("127.0.0.1:%d", port),
		"--tls-cert", srvCert, "--tls-key", srvKey, "--tls-client-ca", ca.certFile)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	target := fmt.Sprintf("127.0.0.1:%d", port)
	opt, err := kvclient.WithMutualTLS(ca.certFile, cliCert, cliKey, "")
	if err != nil {
		t.Fatal(err)
	}
	c, err := kvclient.Dial(target, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.MatchPrefix(ctx, kvclient.Tokens(make([]uint32, 32)), 16, kvclient.MatchOptions{}); err != nil {
		t.Fatalf("with a client certificate: %v", err)
	}
	plain, err := kvclient.Dial(target)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	short, cancel2 := context.WithTimeout(ctx, 3*time.Second)
	defer cancel2()
	if _, err := plain.MatchPrefix(short, kvclient.Tokens(make([]uint32, 32)), 16, kvclient.MatchOptions{}); err == nil {
		t.Fatal("plain text to a TLS port succeeded")
	}
}

type testCA struct {
	cert     *x509.Certificate
	key      *ecdsa.PrivateKey
	certFile string
}

func newTestCA(t *testing.T, dir string) *testCA {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	file := filepath.Join(dir, "ca.crt")
	writePEM(t, file, "CERTIFICATE", der)
	return &testCA{cert, key, file}
}

func (ca *testCA) leaf(t *testing.T, dir, name string) (string, string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		DNSNames: []string{name, "localhost"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		KeyUsage:    x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalPKCS8PrivateKey(key)
	certFile, keyFile := filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	writePEM(t, certFile, "CERTIFICATE", der)
	writePEM(t, keyFile, "PRIVATE KEY", keyDER)
	return certFile, keyFile
}

func writePEM(t *testing.T, path, kind string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// A landing transfer: declared without destination pages, landed by a send from another engine
// of the same service, seen by MatchPrefix as claimable, claimed into the decode engine's pages.
func TestRouterSeesAndClaimsALandedTransfer(t *testing.T) {
	addr := liveService(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := kvclient.Dial(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "go-landing-test")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.CloseSession(ctx, s) }()
	sctx := kvclient.WithSession(ctx, s)
	prompt := make([]uint32, 96) // 6 pages
	for i := range prompt {
		prompt[i] = uint32(5000 + i)
	}
	bsP := engine(t, ctx, c, s, "prefill", prompt)     // holds all 6 pages at 0..5
	bsD := engine(t, ctx, c, s, "decode", prompt[:16]) // holds page 0 only

	st, err := c.ExpectLanding(sctx, "go-l1", bsD, kvclient.Landing{PrefixPages: 1, PrefixPageIndices: []uint32{0},
		PublishTokens: prompt, TTL: 30 * time.Second})
	if err != nil || st.State != pb.TransferState_TRANSFER_STATE_PENDING {
		t.Fatalf("ExpectLanding: %v %v", st, err)
	}
	if _, err := c.Raw().SendDelta(sctx, &pb.SendDeltaRequest{TransferId: "go-l1", BufferSetId: bsP,
		SrcPageIndices: []uint32{0, 1, 2, 3, 4, 5}, LastChunk: true, PeerAddress: addr}); err != nil {
		t.Fatal(err)
	}
	var last pb.TransferState
	err = c.WatchTransfers(ctx, s, []string{"go-l1"}, func(st *pb.TransferStatus) bool {
		if st.Role == pb.TransferRole_TRANSFER_ROLE_RECEIVER {
			last = st.State
		}
		return last != pb.TransferState_TRANSFER_STATE_LANDED && last < pb.TransferState_TRANSFER_STATE_DONE
	})
	if err != nil || last != pb.TransferState_TRANSFER_STATE_LANDED {
		t.Fatalf("watch: last receiver state %v, err %v", last, err)
	}
	m, err := c.MatchPrefix(ctx, kvclient.Tokens(prompt), 16, kvclient.MatchOptions{ScoresOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	best := m.BestClaimable()
	if best == nil || best.BufferSetID != bsD || best.MatchedPages != 1 || best.LandedPages != 6 ||
		best.LandedTransferID != "go-l1" || best.Load.LandedTransfers != 1 || best.Load.LandedBytes != 5*2*256 {
		t.Fatalf("claimable = %+v of %+v", best, m)
	}
	if _, err := c.Claim(sctx, "go-l1", bsD, []uint32{1, 2, 3}, time.Second); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a claim of 3 pages for 5 landed: %v", err)
	}
	r, err := c.Claim(sctx, "go-l1", bsD, []uint32{1, 2, 3, 4, 5}, time.Second)
	if err != nil || r.Status.State != pb.TransferState_TRANSFER_STATE_DONE {
		t.Fatalf("claim: %v %v", r, err)
	}
	if _, err := c.Claim(sctx, "go-l1", bsD, []uint32{1, 2, 3, 4, 5}, time.Second); status.Code(err) != codes.FailedPrecondition ||
		!strings.Contains(err.Error(), "ended DONE") {
		t.Fatalf("a second claim must say the transfer ended: %v", err)
	}
	m, err = c.MatchPrefix(ctx, kvclient.Tokens(prompt), 16, kvclient.MatchOptions{BufferSetIDs: []string{bsD}})
	if err != nil || m.Matches[0].MatchedPages != 6 || m.BestClaimable() != nil {
		t.Fatalf("after the claim the decode engine holds the prompt: %+v %v", m, err)
	}
}
